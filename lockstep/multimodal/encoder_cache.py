"""The vision tower's outputs by image content hash: the same image in another request (or its
retracted request resumed) is encoded once. Least recently used entries go first past the byte
budget. Each rank keeps its own; they see the same batches in the same order, so they hit and
miss alike."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_BUDGET_BYTES = 256 << 20


@dataclass
class EncoderStats:
    runs: int = 0  # images the tower encoded
    hits: int = 0  # image lookups served from the cache


class EncoderCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget = budget_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.stats = EncoderStats()

    def get(self, digest: str) -> torch.Tensor | None:
        feats = self.entries.get(digest)
        if feats is not None:
            self.entries.move_to_end(digest)
            self.stats.hits += 1
        return feats

    def put(self, digest: str, feats: torch.Tensor) -> None:
        self.stats.runs += 1
        size = feats.numel() * feats.element_size()
        if size > self.budget:
            return  # larger than the whole budget: used once, kept by nobody
        self.entries[digest] = feats
        self.bytes += size
        while self.bytes > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.distributed.parallel_state import ParallelGroup
from lockstep.layers.linear import _copy, _param
from lockstep.layers.quantization import PackedLinear, pack


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # Pad so the vocabulary splits evenly; padded rows are zero and never sampled.
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        self.start, self.end = tp.shard_range(self.padded_vocab)
        self.weight = _param((self.end - self.start, hidden), dtype, self.weight_loader)
        # --quantization: a packed copy for logits; lookups keep the float32 rows.
        self.logits_packed: PackedLinear | None = None

    def pack_logits_weights(self, method: str) -> None:
        self.logits_packed = pack(method, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.start:min(self.end, self.vocab_size)]
        param.data.zero_()
        _copy(param.data[: shard.shape[0]], shard, "vocab-parallel embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab slice, gathered so every rank sees the full row."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_packed is not None:
            local = self.logits_packed(hidden)
        else:
            local = F.linear(hidden, self.weight)
        return self.tp.all_gather(local, dim=-1)[..., : self.vocab_size]

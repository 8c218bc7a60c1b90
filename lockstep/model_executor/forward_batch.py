"""What one forward pass needs: flat tokens of the whole batch plus a per-request descriptor."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, prefill chunk or extend-from-prefix
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # prefill chunks and decodes in one batch


@dataclass
class AttentionMetadata:
    """Built once per forward and shared by every layer: where each request's keys live and
    which keys each query may see (one mask per distinct sliding window)."""

    kv_indices: torch.Tensor  # [B, L] KV slots per request, padded with the scratch slot 0
    q_scatter: torch.Tensor  # [T] flat token -> row in the padded [B * Q] query grid
    max_q: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B,1,Q,L]


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B] tokens already in KV before this pass
    extend_lens: torch.Tensor  # [B] new tokens in this pass
    logits_indices: torch.Tensor  # [S] flat positions whose logits are computed
    attn: AttentionMetadata | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    def build_attention(self, req_to_token: torch.Tensor, windows: set[int | None]) -> None:
        b = self.batch_size
        ext, pre, seq = self.extend_lens, self.prefix_lens, self.seq_lens
        max_q, max_l = int(ext.max()), int(seq.max())
        device = self.input_ids.device
        kv = req_to_token[self.req_pool_indices, :max_l]
        q_idx = torch.arange(max_q, device=device)
        k_idx = torch.arange(max_l, device=device)
        starts = torch.cumsum(ext, 0) - ext
        row_of_token = torch.repeat_interleave(torch.arange(b, device=device), ext)
        col_of_token = torch.arange(ext.sum(), device=device) - starts[row_of_token]
        q_pos = pre[:, None] + q_idx[None, :]  # [B, Q] absolute position of each query
        dist = q_pos[:, :, None] - k_idx[None, None, :]  # [B, Q, L]
        base = (dist >= 0) & (k_idx[None, None, :] < seq[:, None, None])
        padded_q = q_idx[None, :] >= ext[:, None]  # [B, Q]
        masks = {}
        for w in windows:
            m = base if w is None else base & (dist < w)
            # Padding queries see key 0 only, so softmax never divides by zero; they are dropped.
            m = m | (padded_q[:, :, None] & (k_idx == 0)[None, None, :])
            masks[w] = m.unsqueeze(1)
        kv = torch.where(k_idx[None, :] < seq[:, None], kv, 0)
        self.attn = AttentionMetadata(kv, row_of_token * max_q + col_of_token, max_q, masks)

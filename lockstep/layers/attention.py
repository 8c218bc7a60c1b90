"""Attention over the paged KV pool.

Every layer writes its new K/V into the pool first. On a CPU every query row then runs alone in
the decode kernel (lockstep.kernels.decode_attention), which reads its keys in place by slot and sums in an
order fixed by that row's own keys: so its numbers are bitwise the same whatever it is batched with
and however many rows its request extends by (a prefix-cache hit, a chunk, a speculative verify
pass give the bits of a plain prefill or decode). On a GPU one masked SDPA runs over the padded
[batch, query, key] grid, where that holds only as far as cuDNN/flash kernels are deterministic."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.forward_batch import AttentionMetadata, ForwardBatch
from lockstep.kernels import decode_attention
from lockstep.mem_cache.memory_pool import TokenToKVPool


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, n_heads: int, n_kv_heads: int, head_dim: int, scaling: float,
                 window: int | None, softcap: float | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scaling = scaling
        self.window = window
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                pool: TokenToKVPool) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]"""
        meta = fb.attn
        assert meta is not None, "ForwardBatch.build_attention must run before the model"
        pool.set_kv(self.layer_id, fb.out_cache_loc, k, v)
        if q.device.type != "cpu":
            return self._batched(q, fb, meta, pool)
        # Every query row alone, prefill rows as decode rows: the decode kernel, reading its keys in
        # place from the pool. So a position's numbers are the same bits whether it is decoded,
        # prefilled, prefilled over a cached prefix or in another chunk.
        starts, lens, window = meta.row_kv_starts, meta.row_kv_lens, self.window
        if window and window in meta.windowed:  # image rows: the window from each row's position
            (starts, lens), window = meta.windowed[window], None
        return decode_attention(q, pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id],
                                meta.kv_flat, starts, lens, self.scaling, self.softcap, window)

    def _batched(self, q: torch.Tensor, fb: ForwardBatch, meta: AttentionMetadata,
                 pool: TokenToKVPool) -> torch.Tensor:
        b, qn = fb.batch_size, meta.max_q
        # [B, Hkv, L, D], in q's type where the pool keeps another (--kv-cache-dtype)
        keys = self._gather(pool.k_buffer[self.layer_id], meta.kv_indices).to(q.dtype)
        vals = self._gather(pool.v_buffer[self.layer_id], meta.kv_indices).to(q.dtype)
        if qn == 1 and q.shape[0] == b:
            qp = q.view(b, 1, self.n_heads, self.head_dim)
        else:
            qp = q.new_zeros(b * qn, self.n_heads, self.head_dim)
            qp[meta.q_scatter] = q
            qp = qp.view(b, qn, self.n_heads, self.head_dim)
        qp = qp.transpose(1, 2)  # [B, H, Q, D]
        mask = meta.masks[self.window]
        if self.softcap is None and qn > 1:
            out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, scale=self.scaling,
                                                 enable_gqa=self.n_heads != self.n_kv_heads)
        else:
            # Decode (one query per request): two batched matmuls beat CPU SDPA on one query row
            # (docs/benchmarks_archive.md, "Decode step changes (issue 7)").
            out = self._matmul_attention(qp, keys, vals, mask)
        out = out.transpose(1, 2).reshape(b * qn, self.n_heads * self.head_dim)
        return out if qn == 1 and q.shape[0] == b else out[meta.q_scatter]

    @staticmethod
    def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        # index_select on a flat index instead of advanced indexing `buffer[slots]`: the generic
        # index kernel is the slower gather on CPU (docs/benchmarks_archive.md, "Decode step changes (issue 7)").
        rows = buffer.index_select(0, slots.reshape(-1))
        return rows.view(*slots.shape, *buffer.shape[1:]).transpose(1, 2)

    def _matmul_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
        """q: [B, H, Q, D]; k, v: [B, Hkv, L, D]; mask: [B, 1, Q, L] -> [B, H, Q, D].
        The query heads sharing a KV head are stacked into its rows, so K/V are not repeated."""
        b, h, qn, d = q.shape
        hkv = k.shape[1]
        qg = q.reshape(b, hkv, (h // hkv) * qn, d)
        scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(self.scaling)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.view(b, hkv, h // hkv, qn, -1).masked_fill_(~mask.unsqueeze(1), float("-inf"))
        probs = scores.view(b, hkv, (h // hkv) * qn, -1).softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).view(b, h, qn, d)

"""Attention over the paged KV pool, batched across requests of different lengths.

Every layer writes its new K/V into the pool first, then gathers each request's keys by slot
and runs one masked SDPA over the padded [batch, query, key] grid. No Python loop over tokens
or requests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.mem_cache.memory_pool import TokenToKVPool
from lockstep.model_executor.forward_batch import ForwardBatch


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
        b, qn = fb.batch_size, meta.max_q
        keys = pool.k_buffer[self.layer_id][meta.kv_indices].transpose(1, 2)  # [B, Hkv, L, D]
        vals = pool.v_buffer[self.layer_id][meta.kv_indices].transpose(1, 2)
        if qn == 1 and q.shape[0] == b:
            qp = q.view(b, 1, self.n_heads, self.head_dim)
        else:
            qp = q.new_zeros(b * qn, self.n_heads, self.head_dim)
            qp[meta.q_scatter] = q
            qp = qp.view(b, qn, self.n_heads, self.head_dim)
        qp = qp.transpose(1, 2)  # [B, H, Q, D]
        mask = meta.masks[self.window]
        if self.softcap is None:
            out = F.scaled_dot_product_attention(
                qp, keys, vals, attn_mask=mask, scale=self.scaling,
                enable_gqa=self.n_heads != self.n_kv_heads,
            )
        else:
            out = self._softcapped(qp, keys, vals, mask)
        out = out.transpose(1, 2).reshape(b * qn, self.n_heads * self.head_dim)
        return out if qn == 1 and q.shape[0] == b else out[meta.q_scatter]

    def _softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)

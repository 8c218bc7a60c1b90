"""Attention over the paged KV pool.

Every layer writes its new K/V into the pool first. On a CPU each request's attention then runs
on its own exact [query, key] shapes, so its numbers are bitwise the same whatever it is batched
with (padding a request to its neighbours' lengths changes how the softmax and the value sums are
blocked, and so their rounding): a one-query request (decode) in the decode kernel
(lockstep.kernels.decode), which reads its keys in place by slot, a longer one in SDPA over its
gathered keys. On a GPU one masked SDPA runs over the padded [batch, query, key] grid."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.core import AttentionMetadata, ForwardBatch
from lockstep.kernels.decode import decode_attention
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
        if q.device.type == "cpu":
            return self._per_request(q, meta, pool)
        return self._batched(q, fb, meta, pool)

    def _batched(self, q: torch.Tensor, fb: ForwardBatch, meta: AttentionMetadata,
                 pool: TokenToKVPool) -> torch.Tensor:
        b, qn = fb.batch_size, meta.max_q
        keys = self._gather(pool.k_buffer[self.layer_id], meta.kv_indices)  # [B, Hkv, L, D]
        vals = self._gather(pool.v_buffer[self.layer_id], meta.kv_indices)
        if qn == 1 and q.shape[0] == b:
            qp = q.view(b, 1, self.n_heads, self.head_dim)
        else:
            qp = q.new_zeros(b * qn, self.n_heads, self.head_dim)
            qp[meta.q_scatter] = q
            qp = qp.view(b, qn, self.n_heads, self.head_dim)
        qp = qp.transpose(1, 2)  # [B, H, Q, D]
        mask = meta.masks[self.window]
        if self.softcap is None and qn > 1:
            out = F.scaled_dot_product_attention(
                qp, keys, vals, attn_mask=mask, scale=self.scaling,
                enable_gqa=self.n_heads != self.n_kv_heads,
            )
        else:
            # Decode (one query per request): two batched matmuls are ~1.5x faster than CPU SDPA.
            out = self._matmul_attention(qp, keys, vals, mask)
        out = out.transpose(1, 2).reshape(b * qn, self.n_heads * self.head_dim)
        return out if qn == 1 and q.shape[0] == b else out[meta.q_scatter]

    def _per_request(self, q: torch.Tensor, meta: AttentionMetadata,
                     pool: TokenToKVPool) -> torch.Tensor:
        k_buf, v_buf = pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id]
        # Every one-query request (decode) takes the same road whatever shares its batch: the decode
        # kernel, reading its keys in place from the pool.
        one = None
        if meta.one_query_rows is not None and meta.one_query_rows.numel():
            qo = q if meta.max_q == 1 else q.index_select(0, meta.one_query_rows)
            one = decode_attention(qo, k_buf, v_buf, meta.kv_flat, meta.one_query_kv_starts,
                                   meta.one_query_kv_lens, self.scaling, self.softcap, self.window)
            if meta.max_q == 1:
                return one
        # One gather of the batch's keys, unpadded; each request then reads its own rows, laid
        # out in memory as they would be alone.
        keys_all = k_buf.index_select(0, meta.kv_flat)  # [sum L, Hkv, D]
        vals_all = v_buf.index_select(0, meta.kv_flat)
        outs = []
        n_one = 0
        for r, (start, qn, kn, k0) in enumerate(meta.spans):
            if qn == 1:
                outs.append(one[n_one:n_one + 1])
                n_one += 1
                continue
            qr = q[start:start + qn].unsqueeze(0).transpose(1, 2)  # [1, H, Q, D]
            keys = keys_all[k0:k0 + kn].unsqueeze(0).transpose(1, 2)  # [1, Hkv, L, D]
            vals = vals_all[k0:k0 + kn].unsqueeze(0).transpose(1, 2)
            mask = meta.masks[self.window][r:r + 1, :, :qn, :kn]
            if self.softcap is None:
                out = F.scaled_dot_product_attention(
                    qr, keys, vals, attn_mask=mask, scale=self.scaling,
                    enable_gqa=self.n_heads != self.n_kv_heads)
            else:
                out = self._matmul_attention(qr, keys, vals, mask)
            outs.append(out.transpose(1, 2).reshape(qn, self.n_heads * self.head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        # index_select on a flat index instead of advanced indexing `buffer[slots]` (the generic
        # index kernel): a batch-32 decode step is ~14% faster on CPU (docs/benchmarks.md).
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

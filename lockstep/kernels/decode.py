"""Per-step kernels outside the linears: decode attention over the paged KV pool, and the row argmax
of greedy sampling. Each runs compiled when a variant is loaded and its inputs fit, else its torch
reference, which gives the same numbers up to float summation order (argmax: exactly)."""

from __future__ import annotations

import torch

from lockstep.kernels.build import selected


def decode_attention_compiled(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """True when `decode_attention` runs compiled for these operands: float32 on the CPU, head dim a
    multiple of 16 (the kernel's vector width), a compiled variant loaded."""
    return (selected()[1] is not None and q.dtype == torch.float32 and k_buf.dtype == torch.float32
            and q.device.type == "cpu" and k_buf.device.type == "cpu" and q.shape[-1] % 16 == 0)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_slots: torch.Tensor,
                     starts: torch.Tensor, lens: torch.Tensor, scaling: float, softcap: float | None,
                     window: int | None) -> torch.Tensor:
    """One query per request: q [R, H, D] against K/V buffers [S, Hkv, D]; request r sees the pool rows
    kv_slots[starts[r] : starts[r] + lens[r]] (the last `window` of them if windowed) -> [R, H * D].

    Compiled, each request's output is summed in an order fixed by its own keys alone, so it is bitwise
    the same whatever it is batched with."""
    if decode_attention_compiled(q, k_buf):
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()  # the kernel takes rows at any stride, but each row's heads packed
        return selected()[1].decode_attention(q, k_buf, v_buf, kv_slots, starts, lens, scaling,
                                              softcap or 0.0, window or 0)
    return decode_attention_reference(q, k_buf, v_buf, kv_slots, starts, lens, scaling, softcap, window)


def decode_attention_reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                               kv_slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                               scaling: float, softcap: float | None, window: int | None) -> torch.Tensor:
    r, h, d = q.shape
    hkv = k_buf.shape[1]
    # one gather for the batch (a call per request costs more at batch 32), then each request's rows
    keys_all, vals_all = k_buf.index_select(0, kv_slots), v_buf.index_select(0, kv_slots)
    outs = []
    for i, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        lo = 0 if window is None else max(0, n - window)
        keys = keys_all[s + lo:s + n].transpose(0, 1)  # [Hkv, L, D]
        vals = vals_all[s + lo:s + n].transpose(0, 1)
        # the query heads sharing a KV head are stacked into its rows, so K/V are not repeated
        scores = torch.matmul(q[i].reshape(hkv, h // hkv, d), keys.transpose(-1, -2)).mul_(scaling)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        outs.append(torch.matmul(scores.softmax(-1), vals).reshape(1, h * d))
    return torch.cat(outs) if outs else q.new_empty(0, h * d)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row of x [B, V] (a NaN counts as the maximum), int64 [B]."""
    module = selected()[1]
    if module is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 \
            and x.shape[1] > 0 and x.stride(1) == 1:
        return module.argmax_rows(x)
    # max(dim) returns the same first-maximum index as argmax and is faster on CPU (2x alone)
    return x.max(dim=-1).indices

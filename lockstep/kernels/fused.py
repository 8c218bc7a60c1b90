"""Fused row-wise float32 ops of a decoder layer: compiled (csrc/fused.h) where built, else the torch
reference below, which gives the same numbers up to float rounding.

Each takes float32 rows; a row's result depends on that row alone (in the same order at any batch),
so a request's numbers do not depend on what it is batched with. Callers with other dtypes keep
their own torch code (the model's dtype decides where the casts go).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep.kernels.build import selected

COMPILED_ACTS = ("gelu_tanh", "silu")


def _module(*tensors: torch.Tensor):  # noqa: ANN202  (the compiled module, or None)
    mod = selected()[1]
    if mod is None or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return mod


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dim of float32 x [T, D] (weight: the effective float32
    scale, e.g. Gemma's 1 + w)."""
    mod = _module(x, weight)
    if mod is not None and x.dim() == 2 and x.stride(-1) == 1:
        return mod.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, wx: torch.Tensor | None, wy: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual step of float32 rows [T, D]: h2 = h + (rmsnorm(x) * wx if wx given, else x), then
    (h2, rmsnorm(h2) * wy), the second None without wy. h is not modified."""
    mod = _module(h, x)
    if mod is not None and h.dim() == 2 and h.stride(-1) == 1 and x.stride(-1) == 1:
        h2, y = mod.add_rms_norm(h, x, wx, wy, eps)
        return h2, (y if wy is not None else None)
    shape = (h.shape[-1],)
    h2 = h + (x if wx is None else F.rms_norm(x, shape, wx, eps))
    return h2, (None if wy is None else F.rms_norm(h2, shape, wy, eps))


def qk_norm_rope(qkv: torch.Tensor, n_q: int, n_kv: int, head_dim: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [T, n_q, D], k, v [T, n_kv, D] of float32 qkv [T, (n_q + 2 n_kv) D], with q and k
    RMS-normed per head (when weights are given) and rotated by cos/sin [T, D] (rotate-half form),
    in place in qkv."""
    t, d = qkv.shape[0], head_dim
    mod = _module(qkv, cos, sin)
    if mod is not None and qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1:
        mod.qk_norm_rope(qkv, n_q, n_kv, d, q_weight, k_weight, cos, sin, eps)
    else:
        for heads, w in ((qkv[:, :n_q * d].view(t, n_q, d), q_weight),
                         (qkv[:, n_q * d:(n_q + n_kv) * d].view(t, n_kv, d), k_weight)):
            normed = heads if w is None else F.rms_norm(heads, (d,), w, eps)
            heads.copy_(rotate(normed, cos, sin))
    q = qkv[:, :n_q * d].view(t, n_q, d)
    k = qkv[:, n_q * d:(n_q + n_kv) * d].view(t, n_kv, d)
    v = qkv[:, (n_q + n_kv) * d:(n_q + 2 * n_kv) * d].view(t, n_kv, d)
    return q, k, v


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of x [T, H, D] by cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for float32 gate_up [T, 2I] (gate: the first I columns), act one of
    COMPILED_ACTS ("gelu_tanh": the tanh approximation of GELU)."""
    if act not in COMPILED_ACTS:
        raise ValueError(f"act_and_mul: {act!r} is not one of {COMPILED_ACTS}")
    mod = _module(gate_up)
    if mod is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return mod.act_and_mul(gate_up, act)
    gate, up = gate_up.chunk(2, dim=-1)
    g = F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)
    return g * up

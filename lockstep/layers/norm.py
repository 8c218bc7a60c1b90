from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep import kernels
from lockstep.layers.linear import _copy, _param


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + w) where Llama/Qwen scale by w.

    `scale` is that factor in float32, formed once at load (Gemma's 1 + w is not recomputed per
    call); float32 models run the fused kernels on it (`norm`, `add_norm`), other dtypes torch ops
    that cast where HF does."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = _param((dim,), dtype, self._load)
        self.scale = self._scale()

    def _scale(self) -> torch.Tensor:
        w = self.weight.detach().float()
        return (1.0 + w) if self.gemma else w.clone()

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy(param, loaded, "norm weight")
        self.scale = self._scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return kernels.rms_norm(x, self.scale, self.eps)
        # torch's own RMSNorm: bitwise the same as the float32 formula written out, in one call.
        shape = (x.shape[-1],)
        if self.gemma:
            return F.rms_norm(x.float(), shape, self.scale, self.eps).to(x.dtype)
        # Llama casts back before scaling; matching that keeps bf16 outputs equal to HF's.
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


def add_norm(h: torch.Tensor, x: torch.Tensor, x_norm: RMSNorm | None,
             out_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual step between sublayers: h2 = h + (x_norm(x) if given, else x), and out_norm(h2)
    (None without out_norm). float32: one fused call; h is not modified. The two norms are one
    model's, with one eps."""
    if h.dtype == torch.float32 and x.dtype == torch.float32:
        eps = x_norm.eps if x_norm is not None else out_norm.eps if out_norm is not None else 0.0
        return kernels.add_rms_norm(h, x, None if x_norm is None else x_norm.scale,
                                  None if out_norm is None else out_norm.scale, eps)
    h2 = h + (x if x_norm is None else x_norm(x))
    return h2, (None if out_norm is None else out_norm(h2))

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.layers.linear import _copy, _param


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + w) where Llama/Qwen scale by w."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = _param((dim,), dtype, lambda p, w: _copy(p, w, "norm weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's own RMSNorm: bitwise the same as the float32 formula written out, in one call.
        shape = (x.shape[-1],)
        if self.gemma:
            return F.rms_norm(x.float(), shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)
        # Llama casts back before scaling; matching that keeps bf16 outputs equal to HF's.
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)

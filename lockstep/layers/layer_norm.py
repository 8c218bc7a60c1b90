"""LayerNorm with a bias (BERT's): torch's own, replicated on every TP rank. Each row is
normalized alone, so a token's numbers do not depend on its batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.layers.linear import _copy, _param


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype, self._load)
        self.bias = _param((dim,), dtype, self._load)

    @staticmethod
    def _load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy(param, loaded, "layer norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

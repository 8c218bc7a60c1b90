"""The last step of every model's load_weights: a checkpoint tensor into its parameter through the
parameter's own `weight_loader` (which knows its TP shard and stacked parts), and the check that
nothing the model declares was left out of the checkpoint."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lockstep.layers.block_weight import BlockWeight


def load_param(param: nn.Parameter, tensor: torch.Tensor | BlockWeight, shard: object | None = None) -> None:
    """Float tensors are cast to the parameter's dtype first; block weights go as they are."""
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.to(param.dtype)
    loader = param.weight_loader  # type: ignore[attr-defined]
    with torch.no_grad():
        loader(param, tensor) if shard is None else loader(param, tensor, shard)


def all_loaded(params: Iterable[str], loaded: set[str], what: str = "tensors") -> set[str]:
    """`loaded`, or a KeyError naming (up to 8 of) the declared parameters the checkpoint lacks."""
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"checkpoint is missing {what}: {sorted(missing)[:8]}")
    return loaded

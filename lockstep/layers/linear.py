"""Tensor-parallel linear layers. Each parameter carries a `weight_loader` that takes the full
checkpoint tensor and copies in only this rank's shard, so a rank never holds more than its part."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.distributed.parallel_state import ParallelGroup
from lockstep.layers.quantization import PackedLinear, pack

WeightLoader = Callable[..., None]


def _param(shape: Sequence[int], dtype: torch.dtype, loader: WeightLoader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _copy(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.out_local = out_features // tp.size
        tp.shard_range(out_features)  # validates divisibility
        self.weight = _param((self.out_local, in_features), dtype, self.weight_loader)
        self.bias = _param((self.out_local,), dtype, self.weight_loader) if bias else None
        self.packed: PackedLinear | None = None  # --quantization: replaces weight and bias

    def pack_weights(self, method: str) -> None:
        """After loading: keep the weight only in `method`'s packed form (see quantization.py)."""
        self.packed = pack(method, self.weight, self.bias)
        self.weight = self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        start, end = self.tp.shard_range(loaded.shape[0])
        _copy(param, loaded[start:end], "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused into one matmul (gate+up)."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool, tp: ParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype)
        self.out_sizes = list(out_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        size = self.out_sizes[shard_id] // self.tp.size
        start, end = self.tp.shard_range(loaded.shape[0])
        _copy(param.data.narrow(0, offset, size), loaded[start:end], f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Query heads split across ranks; KV heads split too, or replicated
    when there are more ranks than KV heads (each rank keeps the KV head its queries use)."""

    def __init__(self, hidden: int, head_dim: int, n_heads: int, n_kv_heads: int, bias: bool,
                 tp: ParallelGroup, dtype: torch.dtype) -> None:
        if n_heads % tp.size:
            raise ValueError(f"{n_heads} attention heads do not split over tp size {tp.size}")
        if n_kv_heads % tp.size and tp.size % n_kv_heads:
            raise ValueError(f"{n_kv_heads} KV heads do not split over tp size {tp.size}")
        self.head_dim = head_dim
        self.n_heads_local = n_heads // tp.size
        self.n_kv_local = max(1, n_kv_heads // tp.size)
        self.n_kv_total = n_kv_heads
        local_out = (self.n_heads_local + 2 * self.n_kv_local) * head_dim
        super().__init__(hidden, local_out * tp.size, bias, tp, dtype)

    def kv_head_start(self) -> int:
        if self.n_kv_total >= self.tp.size:
            return self.tp.rank * self.n_kv_local
        return self.tp.rank * self.n_kv_total // self.tp.size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        d = self.head_dim
        q_size, kv_size = self.n_heads_local * d, self.n_kv_local * d
        if shard_id == "q":
            start, size, dst = self.tp.rank * q_size, q_size, 0
        else:
            start, size = self.kv_head_start() * d, kv_size
            dst = q_size if shard_id == "k" else q_size + kv_size
        _copy(param.data.narrow(0, dst, size), loaded[start:start + size], f"qkv shard {shard_id}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        return qkv.split([self.n_heads_local * d, self.n_kv_local * d, self.n_kv_local * d], -1)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        tp.shard_range(in_features)
        self.weight = _param((out_features, in_features // tp.size), dtype, self.weight_loader)
        self.bias: nn.Parameter | None = (
            _param((out_features,), dtype, self.bias_loader) if bias else None
        )
        self.packed: PackedLinear | None = None  # --quantization: replaces weight

    def pack_weights(self, method: str) -> None:
        # Without the bias: it is added once after the reduction, not by every rank.
        self.packed = pack(method, self.weight)
        self.weight = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        start, end = self.tp.shard_range(loaded.shape[1])
        _copy(param, loaded[:, start:end], "row-parallel weight")

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy(param, loaded, "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
        y = self.tp.all_reduce(local)
        # The bias is added once, after the reduction, not once per rank.
        return y if self.bias is None else y + self.bias

"""Tensor-parallel linear layers. Each parameter carries a `weight_loader` that takes the full
checkpoint tensor and keeps only this rank's shard, so a rank never holds more than its part.

A float checkpoint's weight is copied into the float parameter. A GGUF's weight arrives as a
`BlockWeight` and stays in its blocks: the loader keeps this rank's output rows (every layer
here is split by output rows, see RowParallelLinear), one part per checkpoint tensor, and
`finish_loading` settles them as the weight plan decides (weight_plan.py: a kernel, or floats
dequantized once); a float32 weight on a CPU becomes F32 blocks there too, so every linear's
output rows are batch invariant. Fused layers (q/k/v, gate/up) whose parts have different block
types keep one part each and concatenate the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.distributed.parallel_state import ParallelGroup
from lockstep.layers.block_weight import BlockWeight, Part, matmul_parts, pack
from lockstep.layers.weight_plan import WeightPlan

WeightLoader = Callable[..., None]


def _param(shape: Sequence[int], dtype: torch.dtype, loader: WeightLoader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _copy(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class _BlockParts(nn.Module):
    """The weight of a linear: the float parameter `weight` until `finish_loading`; after it,
    either `weight` (one float part, torch's matmul with the bias) or `parts` (and `weight` None),
    each of the kind the weight plan chose."""

    weight: nn.Parameter | None
    part_keys: tuple[Hashable, ...] = (0,)  # checkpoint tensors in output-row order
    # LoRA adapters' low-rank products, added to the base output (lockstep.lora.layers.LoraLinear)
    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def _init_parts(self) -> None:
        assert self.weight is not None
        self.parts: list[Part] | None = None
        self._loaded: dict[Hashable, BlockWeight] = {}

    def _check_part(self, key: Hashable, part: BlockWeight, rows: int, cols: int) -> None:
        if part.shape != (rows, cols):
            raise ValueError(f"{part.name}: shard {part.shape} does not fit ({rows}, {cols})")
        self._loaded[key] = part

    def pack(self, qtype: str, name: str) -> None:
        """--quantization: this float weight becomes `qtype` blocks (before finish_loading)."""
        if self.weight is not None and not self._loaded:
            self._loaded = {self.part_keys[0]: pack(self.weight, qtype, name)}
            self.part_keys = self.part_keys[:1]

    def finish_loading(self, plan: WeightPlan) -> None:
        """Settle the weight as `plan` decides: loaded block parts, or the float parameter."""
        if self._loaded:
            missing = [k for k in self.part_keys if k not in self._loaded]
            if missing:
                raise KeyError(f"no checkpoint tensor for part(s) {missing} of a fused linear")
            parts = plan.parts([self._loaded[k] for k in self.part_keys])
        else:
            if self.weight is None:
                return  # settled already
            parts = plan.float_weight(self.weight.data)
        self._loaded = {}
        if len(parts) == 1 and isinstance(parts[0], torch.Tensor):
            if parts[0] is not getattr(self.weight, "data", None):
                self.weight = nn.Parameter(parts[0], requires_grad=False)
            self.parts = None
        else:
            self.weight = None
            self.parts = parts

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.parts is None:
            y = F.linear(x, self.weight, bias)
        else:
            y = matmul_parts(x, self.parts)
            y = y if bias is None else y.add_(bias)  # y is fresh: no second [T, N] tensor
        return y if self.lora is None else self.lora(x, y)


class ColumnParallelLinear(_BlockParts):
    """y = x W^T with W split by output rows; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_local = out_features // tp.size
        tp.shard_range(out_features)  # validates divisibility
        self.weight = _param((self.out_local, in_features), dtype, self.weight_loader)
        self.bias = _param((self.out_local,), dtype, self.weight_loader) if bias else None
        self._init_parts()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | BlockWeight) -> None:
        self._load_rows(param, loaded, 0, *self.tp.shard_range(loaded.shape[0]),
                        "column-parallel weight")

    def _load_rows(self, dst: torch.Tensor, loaded: torch.Tensor | BlockWeight, key: Hashable,
                   start: int, end: int, what: str) -> None:
        """Checkpoint rows [start, end) into `dst` (rows of the float parameter), or for blocks
        kept as part `key`; either must have dst's rows."""
        if isinstance(loaded, BlockWeight):
            self._check_part(key, loaded.rows(start, end), dst.shape[0], self.in_features)
        else:
            _copy(dst, loaded[start:end], what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused into one matmul (gate+up)."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool, tp: ParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype)
        self.out_sizes = list(out_sizes)
        self.part_keys = tuple(range(len(out_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | BlockWeight,
                      shard_id: int = 0) -> None:
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        size = self.out_sizes[shard_id] // self.tp.size
        self._load_rows(param.data.narrow(0, offset, size), loaded, shard_id,
                        *self.tp.shard_range(loaded.shape[0]), f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Query heads split across ranks; KV heads split too, or replicated
    when there are more ranks than KV heads (each rank keeps the KV head its queries use)."""

    part_keys = ("q", "k", "v")

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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | BlockWeight,
                      shard_id: str = "q") -> None:
        d = self.head_dim
        q_size, kv_size = self.n_heads_local * d, self.n_kv_local * d
        if shard_id == "q":
            start, size, dst = self.tp.rank * q_size, q_size, 0
        else:
            start, size = self.kv_head_start() * d, kv_size
            dst = q_size if shard_id == "k" else q_size + kv_size
        self._load_rows(param.data.narrow(0, dst, size), loaded, shard_id, start, start + size,
                        f"qkv shard {shard_id}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        return qkv.split([self.n_heads_local * d, self.n_kv_local * d, self.n_kv_local * d], -1)


class RowParallelLinear(ColumnParallelLinear):
    """y = x W^T for an x that arrives split by input columns (a column-parallel layer's output).

    Not the usual all-reduce of partial sums: the ranks all-gather x, each multiplies it by its
    share of W's output rows over the whole input dimension, and the rows are all-gathered. So
    every output element is one dot product in TP 1's order and TP N gives TP 1's bits. Partial
    sums added across ranks round differently in the last bit, and on the int8 path the next
    layer's quantization can turn that bit into a different token (measured on Gemma 3 270M)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self._matmul(self.tp.all_gather(x, dim=-1), self.bias), dim=-1)

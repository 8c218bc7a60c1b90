"""A weight kept in GGML's blocks (a GGUF's own bytes, float weights packed at load, or float32
rows as F32 "blocks"), and the kinds of multiplication a linear's parts run on.

Rows are output features; each row is whole blocks along the input dimension, so a row range is a
tensor-parallel shard. Which kind each part runs is decided once, at load, by the weight plan
(weight_plan.choose); after that every matmul here switches on the part's kind alone."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

import torch
import torch.nn.functional as F

from lockstep import kernels
from lockstep.kernels import BlockType


class Kind(StrEnum):
    """How a part of a linear is multiplied (weight_plan.choose picks one per part at load).
    LoRA adapters are not a kind: their products run beside a part of any kind (lockstep.lora)."""

    EXACT = "exact"  # float32 rows x blocks, kernels.linear: each output summed in a fixed order
    INT8 = "int8"  # rows quantized per block of 32 to int8, kernels.linear_int8 (llama.cpp's arithmetic)
    AMX_BF16 = "amx_bf16"  # bfloat16 rows x blocks on AMX tiles, kernels.linear_bf16
    FLOAT = "float"  # a float tensor, torch's matmul (a GPU, a 16-bit dtype without AMX, no kernel)


@dataclass(frozen=True)
class BlockWeight:
    blocks: torch.Tensor  # uint8 [rows, row_bytes]
    qtype: BlockType  # the layout of `blocks`
    n_cols: int  # input features
    name: str = ""  # the checkpoint tensor, for error messages
    kind: Kind = Kind.EXACT  # set by the weight plan at load; a block kind, never FLOAT
    stored: str = ""  # the checkpoint's GGML type where `qtype` differs from it ("Q2_K", "Q4_K"...)

    def __post_init__(self) -> None:
        if type(self.qtype) is not BlockType:
            raise TypeError(f"{self.name or 'a block weight'}: qtype must be a kernels.BlockType, "
                            f"got {self.qtype!r} (kernels.block_type(name) gives one)")

    @property
    def stored_type(self) -> str:
        """The GGML type of these values in the checkpoint (what the plan's summary counts)."""
        return self.stored or self.qtype.value

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.n_cols)

    def rows(self, start: int, end: int) -> BlockWeight:
        return replace(self, blocks=self.blocks[start:end])

    def take_rows(self, index: torch.Tensor) -> BlockWeight:
        return replace(self, blocks=self.blocks[index])

    def padded_rows(self, n: int) -> BlockWeight:
        """`n` rows: these, then zero bytes (zero values in every GGML type)."""
        extra = n - self.blocks.shape[0]
        if extra <= 0:
            return self
        return replace(self, blocks=F.pad(self.blocks, (0, 0, 0, extra)))

    def dequantize(self) -> torch.Tensor:
        return kernels.dequantize(self.qtype, self.blocks, self.n_cols)


def float32_rows(weight: torch.Tensor, name: str = "") -> BlockWeight:
    """Float32 rows [N, K] as F32 blocks over the same memory (no copy): what the exact kernel reads
    to multiply a float checkpoint's weight in a fixed order per output element."""
    rows = weight.detach()
    return BlockWeight(rows.view(torch.uint8), BlockType.F32, rows.shape[-1], name)


def pack(weight: torch.Tensor, qtype: str, name: str = "") -> BlockWeight:
    """Float weight [N, K] -> `qtype` blocks (`--quantization` for float checkpoints)."""
    kind = kernels.block_type(qtype)
    if weight.shape[-1] % kind.per_block:
        raise ValueError(f"{name or 'a weight'}: its {weight.shape[-1]} input columns are not whole "
                         f"{qtype} blocks of {kind.per_block}; serve it without --quantization")
    blocks = kernels.quantize(kind, weight.detach().float().contiguous())
    return BlockWeight(blocks, kind, weight.shape[-1], name)


Part = BlockWeight | torch.Tensor  # blocks a kernel multiplies by, or float rows (Kind.FLOAT)


def part_kind(part: Part) -> Kind:
    return part.kind if isinstance(part, BlockWeight) else Kind.FLOAT


def block_matmul(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """x [..., K] @ weight^T -> [..., N] in x's dtype, on the kernel of the part's kind. Each is batch
    invariant: a row's output depends on that row and the weight alone. AMX bfloat16: widening x to
    float32 first loses nothing, since the kernel rounds it back to bfloat16."""
    rows = x.reshape(-1, weight.n_cols)
    match weight.kind:
        case Kind.EXACT:
            y = kernels.linear(rows.contiguous(), weight.blocks, weight.qtype, weight.n_cols)
        case Kind.INT8:
            y = kernels.linear_int8(rows.contiguous(), weight.blocks, weight.qtype, weight.n_cols)
        case Kind.AMX_BF16:
            y = kernels.linear_bf16(rows.float(), weight.blocks, weight.qtype, weight.n_cols).to(x.dtype)
        case _:
            raise ValueError(f"{weight.name}: {weight.kind} is not a block kind")
    return y.view(*x.shape[:-1], y.shape[-1])


# the kinds whose parts one kernel call multiplies side by side (kernels.linear_parts, linear_int8_parts)
_PARTS_CALL = {Kind.EXACT: kernels.linear_parts, Kind.INT8: kernels.linear_int8_parts}


def matmul_parts(x: torch.Tensor, parts: list[Part]) -> torch.Tensor:
    """x @ (parts stacked by rows)^T, outputs side by side: 2-D rows times parts all of one kind that
    a parts call serves, in that one call; else one matmul per part."""
    kinds = {part_kind(p) for p in parts}
    if x.dim() == 2 and len(kinds) == 1 and (call := _PARTS_CALL.get(kinds.pop())) is not None:
        return call(x, [(p.blocks, p.qtype) for p in parts], parts[0].n_cols)
    outs = [block_matmul(x, p) if isinstance(p, BlockWeight) else F.linear(x, p) for p in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

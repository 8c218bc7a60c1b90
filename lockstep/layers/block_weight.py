"""A weight kept in GGML's quantized blocks (a GGUF's own bytes, or float weights packed at load).

Rows are output features; each row is whole blocks along the input dimension, so a row range is a
tensor-parallel shard. `lockstep.kernels`
multiplies by the blocks directly; where it has no compiled kernel for a type, the layer holding
the weight dequantizes it once at load instead (see `BlockLinearParts`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from lockstep import kernels


@dataclass(frozen=True)
class BlockWeight:
    blocks: torch.Tensor  # uint8 [rows, row_bytes]
    qtype: str  # a GGML type name: "Q8_0", "Q4_K", "F32", ... (a kernels.BlockType where they read it)
    n_cols: int  # input features
    name: str = ""  # the checkpoint tensor, for error messages
    # multiplied with activations quantized to int8 (--int8-activations); set by `settle`
    int8_activations: bool = False

    def __post_init__(self) -> None:
        # the kernels' BlockType for a type they read (resolved once here, not per call); other GGML
        # types (Q2_K, the IQ types) keep their name until the loader dequantizes them
        if self.qtype in kernels.GGML_BLOCKS:
            object.__setattr__(self, "qtype", kernels.block_type(self.qtype))

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


def pack(weight: torch.Tensor, qtype: str, name: str = "") -> BlockWeight:
    """Float weight [N, K] -> `qtype` blocks (`--quantization` for float checkpoints)."""
    per_block = kernels.GGML_BLOCKS[qtype][0]
    if weight.shape[-1] % per_block:
        raise ValueError(f"{name or 'a weight'}: its {weight.shape[-1]} input columns are not whole "
                         f"{qtype} blocks of {per_block}; serve it without --quantization")
    blocks = kernels.quantize(qtype, weight.detach().float().contiguous())
    return BlockWeight(blocks, qtype, weight.shape[-1], name)


def uses_kernel(weight: BlockWeight, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a layer of this dtype on this device multiplies by the blocks themselves: float32
    layers on the exact kernels, bfloat16 layers on the AMX bfloat16 kernels where this CPU runs
    them; anything else runs on dequantized floats (torch's bfloat16 matmul, as before)."""
    if device.type != "cpu" or weight.qtype not in kernels.GGML_BLOCKS:
        return False
    if dtype == torch.float32:
        return kernels.compiled("linear")
    return dtype == torch.bfloat16 and kernels.compiled("linear_bf16")


def block_matmul(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """x [..., K] @ weight^T -> [..., N] in x's dtype. float32 x: the exact kernel, or the int8
    one where `settle` chose it (--int8-activations: x quantized per block of 32, batch invariant
    too). bfloat16 x (--dtype bfloat16): the AMX kernel, which sums bf16 products in float32, batch
    invariant; widening x to float32 first loses nothing since the kernel rounds it back to bf16."""
    rows = x.reshape(-1, weight.n_cols)
    if weight.int8_activations:
        y = kernels.linear_int8(rows.contiguous(), weight.blocks, weight.qtype, weight.n_cols)
    elif x.dtype == torch.bfloat16:
        y = kernels.linear_bf16(rows.float(), weight.blocks, weight.qtype, weight.n_cols)
        y = y.to(torch.bfloat16)
    else:
        y = kernels.linear(rows.contiguous(), weight.blocks, weight.qtype, weight.n_cols)
    return y.view(*x.shape[:-1], y.shape[-1])


Part = BlockWeight | torch.Tensor  # blocks a kernel multiplies by, or float rows


def settle(parts: list[BlockWeight], dtype: torch.dtype, device: torch.device,
           int8_activations: bool = False) -> tuple[list[Part], list[str]]:
    """What a layer multiplies by, from its loaded block parts (in output-row order): blocks where
    a kernel serves their type here, else floats dequantized once now; neighbours of one kind
    merged so that a layer whose parts agree runs one matmul. Also the types dequantized.
    With `int8_activations` (float32 on a CPU), integer block types run kernels.linear_int8 (its
    torch reference gives the same numbers where nothing is compiled), in the layout it reads
    fastest (kernels.unpack_for_int8: Q5_0, Q4_K and Q6_K unpacked, the same numbers); float ones
    stay exact."""
    settled: list[Part] = []
    dequantized: list[str] = []
    int8 = int8_activations and dtype == torch.float32 and device.type == "cpu"
    for w in parts:
        part: Part = w
        if int8 and w.qtype in kernels.INT8_QTYPES:  # in the layout the int8 kernels read fastest
            kind, blocks = kernels.unpack_for_int8(w.qtype, w.blocks, w.n_cols)
            part = replace(w, blocks=blocks, qtype=kind, int8_activations=True)
        elif not uses_kernel(w, dtype, device):
            part = w.dequantize().to(device=device, dtype=dtype)
            dequantized.append(w.qtype)
        prev = settled[-1] if settled else None
        if isinstance(prev, torch.Tensor) and isinstance(part, torch.Tensor):
            settled[-1] = torch.cat([prev, part])
        elif (isinstance(prev, BlockWeight) and isinstance(part, BlockWeight)
              and (prev.qtype, prev.n_cols, prev.int8_activations)
              == (part.qtype, part.n_cols, part.int8_activations)):
            settled[-1] = replace(prev, blocks=torch.cat([prev.blocks, part.blocks]))
        else:
            settled.append(part)
    return settled, dequantized


def matmul_parts(x: torch.Tensor, parts: list[Part]) -> torch.Tensor:
    """x @ (parts stacked by rows)^T, outputs side by side: float32 rows [T, K] times parts that
    all run the exact kernel, or all the int8 one, in one call (kernels.linear_parts,
    kernels.linear_int8_parts), else one matmul per part."""
    if x.dtype == torch.float32 and x.dim() == 2 and all(isinstance(p, BlockWeight) for p in parts):
        int8 = {p.int8_activations for p in parts}
        if int8 == {False}:
            return kernels.linear_parts(x, [(p.blocks, p.qtype) for p in parts], parts[0].n_cols)
        if int8 == {True}:
            return kernels.linear_int8_parts(x, [(p.blocks, p.qtype) for p in parts], parts[0].n_cols)
    outs = [block_matmul(x, p) if isinstance(p, BlockWeight) else F.linear(x, p) for p in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

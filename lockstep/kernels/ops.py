"""The kernels' public entry points: the compiled variant when there is one, the torch reference otherwise."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep.kernels.blocks import (
    GGML_BLOCKS,
    INT8_QTYPES,
    check_blocks,
    dequantize,
    linear_int8_reference,
)
from lockstep.kernels.build import missing_flags, selected

# the compiled kernels work in groups of 32 input elements; float rows of other lengths use the reference
_GROUP = 32


def kernel_variant() -> str:
    """"avx512" | "avx2" | "torch": the variant this process serves with (selected once, see build.py)."""
    return selected()[0]


def has_kernel(qtype: str) -> bool:
    """True when a compiled kernel serves `qtype` on this machine now."""
    return qtype in GGML_BLOCKS and selected()[1] is not None


def _compiled_serves(x: torch.Tensor, blocks: torch.Tensor, n_cols: int) -> bool:
    """The compiled kernels take CPU tensors, rows of whole 32-element groups, bytes contiguous in a row."""
    return (selected()[1] is not None and n_cols % _GROUP == 0 and blocks.stride(1) == 1
            and x.device.type == "cpu" and blocks.device.type == "cpu")


def _check_x(x: torch.Tensor, n_cols: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != n_cols:
        raise ValueError(f"linear takes float32 x [M, {n_cols}], got {x.dtype} {list(x.shape)}")


def linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequantize(qtype, blocks, K).T for float32 x [M, K=n_cols].

    On the compiled path each output element is summed in an order that depends on nothing but that
    element, so a row of y is bitwise the same whatever M and the other rows of x are.
    """
    check_blocks(qtype, blocks, n_cols)
    _check_x(x, n_cols)
    if _compiled_serves(x, blocks, n_cols):
        return selected()[1].linear(x.contiguous(), blocks, qtype, n_cols)
    return x @ dequantize(qtype, blocks, n_cols).T


def linear_parts(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, str]], n_cols: int) -> torch.Tensor:
    """x [M, K] @ [W_0; W_1; ...].T -> [M, sum N_i], W_i = dequantize(qtype_i, blocks_i, K): the
    parts of a fused layer, each of its own block type, in one call (compiled: one parallel region
    over every part at small M). Each output element as `linear` computes it. The parts are
    checked here once per call, cheaply: callers validate blocks at load."""
    _check_x(x, n_cols)
    if selected()[1] is not None and n_cols % _GROUP == 0 and x.device.type == "cpu" and all(
            b.stride(1) == 1 and b.device.type == "cpu" for b, _ in parts):
        return selected()[1].linear_parts(x.contiguous(), [b for b, _ in parts],
                                          [q for _, q in parts], n_cols)
    outs = [linear(x, b, q, n_cols) for b, q in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def embedding(ids: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """Rows `ids` of the blocks, dequantized: float32 [*ids.shape, n_cols] (ids must be in range)."""
    check_blocks(qtype, blocks, n_cols)
    flat = ids.reshape(-1).to(torch.int64)
    if _compiled_serves(flat, blocks, n_cols):
        out = selected()[1].embedding(flat.contiguous(), blocks, qtype, n_cols)
    else:
        out = dequantize(qtype, blocks[flat], n_cols)
    return out.reshape(*ids.shape, n_cols)


def has_bf16_kernel(qtype: str) -> bool:
    """True when `linear_bf16` runs compiled (AMX tiles) for `qtype` on this machine now."""
    return has_kernel(qtype) and kernel_variant() == "avx512" and not missing_flags("amx_bf16")


def linear_bf16(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """Opt-in batched path: y = bf16(x) @ bf16(dequantize(W)).T, float32 out, for float32 x [M, K].

    Both operands are rounded to bfloat16 (the weights after exact dequantization), products are
    summed in float32. Compiled (AMX) it is still batch invariant, as `linear` is, and several times
    faster than `linear` at batch 32; the numbers differ from `linear`'s by bfloat16 rounding, so
    callers offer it behind a flag. The fallback is a float32 matmul of the bf16-rounded operands (not batch invariant).
    """
    check_blocks(qtype, blocks, n_cols)
    _check_x(x, n_cols)
    xb = x.to(torch.bfloat16).contiguous()
    if has_bf16_kernel(qtype) and _compiled_serves(x, blocks, n_cols):
        return selected()[1].linear_amx_bf16(xb, blocks, qtype, n_cols)
    # float32 sums of the bf16-rounded operands: a bf16 matmul would round its output to bfloat16
    # too (an error of 0.09 at K=256, which failed the reference on every CPU without AMX).
    return xb.float() @ dequantize(qtype, blocks, n_cols).to(torch.bfloat16).float().T


def has_int8_kernel(qtype: str) -> bool:
    """True when `linear_int8` runs compiled for `qtype` on this machine now (the AVX-512 variant needs VNNI)."""
    return (qtype in INT8_QTYPES and has_kernel(qtype)
            and (kernel_variant() != "avx512" or not missing_flags("int8_vnni")))


def linear_int8(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """Opt-in batched path, llama.cpp's arithmetic: each row of float32 x [M, K] quantized per block of
    32 to int8 with a float32 scale, integer dot products against the weight blocks' quants, scaled
    and summed in float32 per output element in block order -> float32 [M, N].

    Batch invariant like `linear` (a row's output depends on that row and W only) and bitwise the
    same on every variant and the torch reference (`blocks.linear_int8_reference`); the numbers
    differ from `linear`'s by the activation rounding, so callers offer it behind a flag.
    Block types in INT8_QTYPES only (float weights have nothing to gain: use `linear`).
    """
    check_blocks(qtype, blocks, n_cols)
    _check_x(x, n_cols)
    if qtype not in INT8_QTYPES:
        raise ValueError(f"no int8 path for {qtype}; it serves {list(INT8_QTYPES)}")
    if has_int8_kernel(qtype) and _compiled_serves(x, blocks, n_cols):
        return selected()[1].linear_int8(x.contiguous(), blocks, qtype, n_cols)
    return linear_int8_reference(x, blocks, qtype, n_cols)

"""The kernels' public entry points: the compiled variant when there is one, the torch reference otherwise."""

from __future__ import annotations

import torch

from lockstep.kernels.blocks import check_blocks, dequantize


def kernel_variant() -> str:
    """"avx512" | "avx2" | "torch": the variant this process serves with (selected once)."""
    return "torch"


def has_kernel(qtype: str) -> bool:
    """True when a compiled kernel serves `qtype` on this machine now."""
    return False


def _check_x(x: torch.Tensor, n_cols: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != n_cols:
        raise ValueError(f"linear takes float32 x [M, {n_cols}], got {x.dtype} {list(x.shape)}")


def linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequantize(qtype, blocks, K).T for float32 x [M, K=n_cols]."""
    check_blocks(qtype, blocks, n_cols)
    _check_x(x, n_cols)
    return x @ dequantize(qtype, blocks, n_cols).T


def embedding(ids: torch.Tensor, blocks: torch.Tensor, qtype: str, n_cols: int) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of the blocks, dequantized: float32 [T, n_cols]."""
    check_blocks(qtype, blocks, n_cols)
    return dequantize(qtype, blocks[ids.reshape(-1)], n_cols)

"""Weight-only quantisation of the linears and the LM head (`--quantization`).

Each method packs a weight once, after loading, into FBGEMM's layout; the float32 copies of the
linears are dropped. The embedding table keeps its float32 rows for lookups; a tied LM head gets a
packed copy next to it. Activations stay float32 between layers.

`fp16`: float16 weights multiplied by float32 activations in float32
(`quantized.linear_dynamic_fp16`; the conversion happens inside the kernel). On a CPU a decode
step is bound by the bytes of weight it reads, so halving them pays directly. The error is
float16's rounding of each weight (relative 2^-11).

int8 (FBGEMM's integer matmul, with activations scaled per row so that no request's numbers
depend on its batch neighbours) was measured and left out: 1.1-1.4x faster than fp16, but greedy
agreement with float32 fell to 84-93% on the default model (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from lockstep.server_args import QUANTIZATION_METHODS


class PackedLinear(Protocol):
    """A weight in some method's packed form, called like `F.linear(x, weight, bias)`."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Fp16Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float().contiguous(), None if bias is None else bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


_METHODS: dict[str, type[PackedLinear]] = {"fp16": Fp16Linear}


def pack(method: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    return _METHODS[method](weight, bias)


def check_supported(method: str, device: str, dtype: torch.dtype) -> None:
    """Raise a clear error where `method` cannot run, instead of silently not quantising."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization must be one of {QUANTIZATION_METHODS}, not {method!r}")
    if device != "cpu":
        raise ValueError(f"--quantization {method} is a CPU kernel (FBGEMM); on a GPU serve with "
                         "--dtype float16 or bfloat16 instead")
    if dtype != torch.float32:
        raise ValueError(f"--quantization {method} needs float32 activations (--dtype float32), "
                         f"not {dtype}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"--quantization {method} needs a PyTorch build with FBGEMM (x86 CPUs)")


def quantize_model(model: nn.Module, method: str) -> int:
    """Pack every linear and the LM head of `model` (already loaded); returns how many."""
    from lockstep.layers.embedding import VocabParallelEmbedding
    from lockstep.layers.linear import ColumnParallelLinear, RowParallelLinear

    lm_head = getattr(model, "lm_head", None)
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.pack_weights(method)
            count += 1
        elif isinstance(module, VocabParallelEmbedding) and module is lm_head:
            module.pack_logits_weights(method)
            count += 1
    return count

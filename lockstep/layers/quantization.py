"""Weight-only quantisation of the linears and the LM head (`--quantization`).

`fp16`: each weight is stored once as float16 in FBGEMM's packed layout and multiplied by
float32 activations in float32 (`torch.ops.quantized.linear_dynamic_fp16`; the conversion
happens inside the kernel). On a CPU a decode step is bound by the bytes of weights it reads,
so halving them pays directly, and unlike int8 with dynamic activation scales no request's
numbers depend on the other requests in its batch. The error is float16's rounding of each
weight (relative 2^-11); docs/benchmarks.md reports greedy agreement with float32.

The float32 copies of the linears are dropped after packing. The embedding table keeps its
float32 rows for lookups; a tied LM head gets a packed copy next to it.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep.server_args import QUANTIZATION_METHODS


def check_supported(method: str, device: str, dtype: torch.dtype) -> None:
    """Raise a clear error where `method` cannot run, instead of silently not quantising."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization must be one of {QUANTIZATION_METHODS}, not {method!r}")
    if device != "cpu":
        raise ValueError("--quantization fp16 is a CPU kernel (FBGEMM); on a GPU serve with "
                         "--dtype float16 or bfloat16 instead")
    if dtype != torch.float32:
        raise ValueError(f"--quantization fp16 needs float32 activations (--dtype float32), not {dtype}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("--quantization fp16 needs a PyTorch build with FBGEMM (x86 CPUs)")


def pack_fp16(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(),
                                                   None if bias is None else bias.detach().float())


def linear_fp16(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


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

"""CPU kernels that compute on a GGUF's own quantized blocks (see docs and DESIGN.md section 8).

`linear` and `embedding` run compiled C++ (an AVX2 and an AVX-512 variant, picked once at run time) when
the machine has them and fall back to the plain-torch reference in `blocks` otherwise.
"""

from lockstep.kernels.blocks import GGML_BLOCKS, INT8_QTYPES, dequantize, quantize, row_bytes
from lockstep.kernels.ops import (
    embedding,
    has_bf16_kernel,
    has_int8_kernel,
    has_kernel,
    kernel_variant,
    linear,
    linear_bf16,
    linear_int8,
    linear_parts,
)

__all__ = [
    "GGML_BLOCKS",
    "INT8_QTYPES",
    "dequantize",
    "embedding",
    "has_bf16_kernel",
    "has_int8_kernel",
    "has_kernel",
    "kernel_variant",
    "linear",
    "linear_bf16",
    "linear_int8",
    "linear_parts",
    "quantize",
    "row_bytes",
]

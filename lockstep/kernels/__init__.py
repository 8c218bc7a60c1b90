"""CPU kernels that compute on a GGUF's own quantized blocks, and the row-wise ops of a decoder layer
(docs/architecture.md, "Model execution"; measurements in docs/benchmarks.md).

Every op runs the compiled C++ of the variant this process loaded (AVX2 or AVX-512, picked once at run
time) where the operands fit it, else its plain-torch reference (reference.py); dispatch.py is the one
table that says which. Which op multiplies a model's weights is the weight plan's choice, made once at
load (layers/weight_plan.py), from the block-type table here (blocks.py).
"""

from lockstep.kernels.blocks import (
                                  GGML_BLOCKS,
                                  INT8_QTYPES,
                                  BlockType,
                                  block_type,
                                  dequantize,
                                  quantize,
                                  row_bytes,
                                  unpack_for_int8,
)
from lockstep.kernels.dispatch import GROUP, LORA_SLOT_TYPES
from lockstep.kernels.layer_consts import LayerConsts
from lockstep.kernels.ops import (
                                  act_and_mul,
                                  add_rms_norm,
                                  argmax,
                                  compiled,
                                  decode_attention,
                                  decoder_layer,
                                  embedding,
                                  kernel_variant,
                                  linear,
                                  linear_bf16,
                                  linear_int8,
                                  linear_int8_parts,
                                  linear_parts,
                                  lora_sgmv,
                                  qk_norm_rope,
                                  rms_norm,
                                  rotate,
)
from lockstep.kernels.reference import COMPILED_ACTS

__all__ = ["COMPILED_ACTS", "GGML_BLOCKS", "GROUP", "INT8_QTYPES", "LORA_SLOT_TYPES", "BlockType", "LayerConsts", "act_and_mul",
           "add_rms_norm", "argmax", "block_type", "compiled", "decode_attention", "decoder_layer", "dequantize",
           "embedding", "kernel_variant", "linear", "linear_bf16", "linear_int8", "linear_int8_parts", "linear_parts",
           "lora_sgmv", "qk_norm_rope", "quantize", "rms_norm", "rotate", "row_bytes", "unpack_for_int8"]

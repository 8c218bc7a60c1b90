"""Load a model's weights and settle them: GGUF blocks (or a float checkpoint packed into blocks
by --quantization) stay in blocks where a kernel serves their type, else become floats once."""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from lockstep import kernels
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.embedding import VocabParallelEmbedding
from lockstep.layers.linear import ColumnParallelLinear, RowParallelLinear
from lockstep.layers.quantization import QUANTIZATION_TYPES
from lockstep.model_loader.source import ModelSource
from lockstep.model_loader.weights import iter_weights

logger = logging.getLogger(__name__)

_BLOCK_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def load_model_weights(model: nn.Module, source: ModelSource, quantization: str | None,
                       dtype: torch.dtype, device: str, int8_activations: bool | None = None) -> bool:
    """`int8_activations` None is the default: on where it applies (`int8_applies`). Returns whether
    int8 activations are on."""
    if int8_activations is None:
        int8_activations = int8_applies(source, quantization, dtype, device)
    if quantization is not None and source.gguf_file is not None:
        raise ValueError(f"--quantization {quantization}: {source.origin} is a GGUF, its weights "
                         "are quantized blocks already; drop --quantization")
    if int8_activations and source.gguf_file is None and quantization is None:
        raise ValueError(f"--int8-activations multiplies integer weight blocks, and {source.origin} "
                         "is a float checkpoint: add --quantization q8_0 (or q4_0), or drop "
                         "--int8-activations")
    model.load_weights(iter_weights(source))
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _BLOCK_LAYERS)]
    if quantization is not None:
        qtype = QUANTIZATION_TYPES[quantization]
        for name, m in layers:
            m.pack(qtype, f"{name}.weight")
        logger.info("--quantization %s: %d weights packed into %s blocks", quantization,
                    len(layers), qtype)
    dequantized: Counter[str] = Counter()
    for _, m in layers:
        dequantized.update(m.finish_loading(int8_activations))
    model.after_loading()
    if int8_activations:
        _log_int8(model)
    if dequantized:
        _log_dequantized(dequantized, dtype, device)
    return int8_activations


def _log_dequantized(dequantized: Counter[str], dtype: torch.dtype, device: str) -> None:
    types = ", ".join(f"{t} ({n} tensors)" for t, n in sorted(dequantized.items()))
    if dtype != torch.float32 or device != "cpu":
        logger.info("%s on %s: %s dequantized at load (the block kernels run float32 "
                    "activations on a CPU: --dtype auto there)", dtype, device, types)
    else:
        logger.info("no compiled kernel here (variant %s) for %s: dequantized to float32 at load",
                    kernels.kernel_variant(), types)


def int8_applies(source: ModelSource, quantization: str | None, dtype: torch.dtype,
                 device: str) -> bool:
    """Where the default turns int8 activations on: float32 on a CPU, integer blocks to multiply
    (a GGUF, or --quantization q8_0/q4_0) and a compiled int8 kernel. Without the kernel the exact
    path's fallback (blocks dequantized to float32 at load) is the faster of the two."""
    integer = QUANTIZATION_TYPES.get(quantization or "") not in ("F16", "BF16", "F32")
    blocks = source.gguf_file is not None or (quantization is not None and integer)
    return device == "cpu" and dtype == torch.float32 and blocks and kernels.compiled("linear_int8")


def _log_int8(model: nn.Module) -> None:
    types: Counter[str] = Counter()
    for m in model.modules():
        for part in (getattr(m, "parts", None) or []) + (getattr(m, "logits_parts", None) or []):
            if isinstance(part, BlockWeight) and part.int8_activations:
                types[part.qtype] += 1
    logger.info("int8 activations (--no-int8-activations for the exact float32 path): %s (%s)",
                ", ".join(f"{t} ({n} matmuls)" for t, n in sorted(types.items())) or "no weight",
                f"{kernels.kernel_variant()} kernels" if kernels.compiled("linear_int8")
                else "no compiled int8 kernel here: the torch reference serves, slowly")


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's own weight bytes (float parameters and blocks) by kind (qkv_proj, lm_head, ...)
    and in total: what TP sharding and resident memory are measured by."""
    out: dict[str, int] = {"total": 0}

    def add(name: str, nbytes: int) -> None:
        kind = name.split(".")[-2] if "layers." in name else name.split(".")[0]
        out[kind] = out.get(kind, 0) + nbytes
        out["total"] += nbytes

    for name, p in model.named_parameters():
        add(name, p.numel() * p.element_size())
    for name, m in model.named_modules():
        held = list(getattr(m, "parts", None) or [])
        if getattr(m, "table", None) is not None:
            held.append(m.table)
        logits = getattr(m, "logits_parts", None)
        if logits and not (isinstance(logits[0], BlockWeight) and m.table is not None
                           and logits[0].blocks is m.table.blocks):
            held += logits  # a float copy for logits next to the table
        for part in held:
            t = part.blocks if isinstance(part, BlockWeight) else part
            add(f"{name}.weight", t.numel() * t.element_size())
    return out

"""Load a model's weights and settle them by the weight plan (layers/weight_plan.py): GGUF blocks
(or a float checkpoint packed into blocks by --quantization) and float32 rows run on the kernel
the plan chose for each part; the plan's summary goes to the log and /get_server_info."""

from __future__ import annotations

import logging

import torch
from torch import nn

from lockstep import kernels
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.embedding import VocabParallelEmbedding
from lockstep.layers.linear import ColumnParallelLinear, RowParallelLinear
from lockstep.layers.quantization import QUANTIZATION_TYPES
from lockstep.layers.weight_plan import Target, WeightPlan, int8_default
from lockstep.model_loader.source import ModelSource
from lockstep.model_loader.weights import iter_weights

logger = logging.getLogger(__name__)

_BLOCK_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def load_model_weights(model: nn.Module, source: ModelSource, quantization: str | None,
                       dtype: torch.dtype, device: str, int8_activations: bool | None = None) -> WeightPlan:
    """`int8_activations` None is the default: on where it applies (weight_plan.int8_default).
    Returns the plan the layers were settled by."""
    if quantization is not None and source.gguf_file is not None:
        raise ValueError(f"--quantization {quantization}: {source.origin} is a GGUF, its weights "
                         "are quantized blocks already; drop --quantization")
    integer = quantization is not None and QUANTIZATION_TYPES[quantization] in kernels.INT8_QTYPES
    if int8_activations is None:
        int8_activations = int8_default(source.gguf_file is not None or integer, dtype, device)
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
    plan = WeightPlan(Target.here(device, dtype, int8_activations))
    for _, m in layers:
        m.finish_loading(plan)
    model.after_loading()
    logger.info("%s", plan.describe())
    return plan


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's own weight bytes (float parameters and blocks) by kind (qkv_proj, lm_head, ...)
    and in total: what TP sharding and resident memory are measured by. A tensor held twice (a
    float32 table its logits read as F32 rows) counts once."""
    out: dict[str, int] = {"total": 0}
    seen: set[tuple[int, int]] = set()

    def add(name: str, t: torch.Tensor) -> None:
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key in seen:
            return
        seen.add(key)
        kind = name.split(".")[-2] if "layers." in name else name.split(".")[0]
        out[kind] = out.get(kind, 0) + key[1]
        out["total"] += key[1]

    for name, p in model.named_parameters():
        add(name, p)
    for name, m in model.named_modules():
        held = list(getattr(m, "parts", None) or [])
        if getattr(m, "table", None) is not None:
            held.append(m.table)
        held += getattr(m, "logits_parts", None) or []
        for part in held:
            add(f"{name}.weight", part.blocks if isinstance(part, BlockWeight) else part)
    return out

"""Stream (HF name, weight) pairs out of a model source without holding the checkpoint twice.

Safetensors files yield float tensors, one at a time, memory-mapped. A GGUF yields its matrices as
`BlockWeight`s over a memory map of the file itself (the bytes llama.cpp reads, no copy), and its
vectors (norms, biases) as float32 tensors, with llama.cpp's transforms undone as the tensor index
says. A block type the kernels' table does not list (weight_plan.readable; the IQ1-IQ3 types, TQ1_0,
MXFP4, ...: docs/quant_types.md) is dequantized here, once, into float32 rows (GGML's F32 "blocks")
that remember the stored type, so the weight plan records the fallback; one log line per type."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from lockstep.kernels import BlockType
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.weight_plan import fallback_reason, readable
from lockstep.model_loader.layout import TENSOR_INDEX, ModelLoadError
from lockstep.model_loader.source import ModelSource

logger = logging.getLogger(__name__)

Weight = torch.Tensor | BlockWeight


def iter_weights(source: ModelSource) -> Iterator[tuple[str, Weight]]:
    """Every weight of `source` under its HF name."""
    if source.gguf_file is not None:
        yield from iter_gguf_weights(source.gguf_file, source.model_dir / TENSOR_INDEX)
    else:
        yield from iter_safetensors(source.weight_files)


def iter_safetensors(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of `files` under its HF name, read lazily from memory-mapped files."""
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own untyped errors for bad files
            raise ModelLoadError(f"{path}: not a readable safetensors file: {e}") from e
        with handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"{path}: cannot read tensor {name!r}: {e}") from e
                yield name, tensor


def iter_gguf_weights(gguf_path: Path, index_path: Path) -> Iterator[tuple[str, Weight]]:
    entries: dict[str, dict[str, Any]] = json.loads(index_path.read_text())["tensors"]
    try:
        # Copy-on-write: torch wants a writable buffer; nothing writes, so no page is copied.
        data = np.memmap(gguf_path, mode="c")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{gguf_path}: cannot map: {e}") from e
    unknown: Counter[str] = Counter()
    for name, e in entries.items():
        end = e["offset"] + e["nbytes"]
        if end > data.shape[0]:
            raise ModelLoadError(f"{gguf_path}: truncated: {e['gguf']} ends at byte {end}")
        shape, qtype = e["shape"], e["qtype"]
        raw = torch.from_numpy(data[e["offset"]:end]).view(shape[0] if len(shape) == 2 else 1, -1)
        kind = readable(qtype)
        if kind is None:
            weight = _dequantized_f32(raw, qtype, shape[-1], e["gguf"], gguf_path)
            unknown[qtype] += 1
        else:
            weight = BlockWeight(raw, kind, shape[-1], e["gguf"])
        transform = e["transform"] or [None]
        if transform[0] == "unpermute":
            weight = weight.take_rows(_unpermute_rows(shape[0], transform[1]))
        if len(shape) == 1:
            vector = weight.dequantize()[0]
            yield name, vector - 1 if transform[0] == "minus_one" else vector
        else:
            yield name, weight
    for qtype, n in sorted(unknown.items()):
        logger.info("%s: %d %s tensor(s): %s", gguf_path.name, n, qtype, fallback_reason(qtype))


def _dequantized_f32(raw: torch.Tensor, qtype: str, n_cols: int, name: str, gguf_path: Path) -> BlockWeight:
    """gguf's numpy dequantization of a type the kernels lack, as F32 rows that name `qtype`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        values = dequantize(raw.numpy(), GGMLQuantizationType[qtype])
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: cannot dequantize {name} ({qtype}): {e}") from e
    rows = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return BlockWeight(rows.view(torch.uint8), BlockType.F32, n_cols, name, stored=qtype)


def _unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: it interleaves each head's two rotary
    halves row by row; HF keeps them split. A permutation of whole rows, so blocks follow."""
    grouped = torch.arange(n_rows).view(n_heads, n_rows // n_heads // 2, 2)
    return grouped.transpose(1, 2).reshape(n_rows)

"""Stream (name, tensor) pairs out of safetensors files, one tensor in memory at a time."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from lockstep.model_loader.source import ModelLoadError


def iter_weights(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
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

"""The HF float model of a lockstep model directory, for the oracle.

An HF directory loads with `from_pretrained`. A GGUF's cache entry holds no float weights (they
stay in the GGUF's blocks): its HF model is built from the cached config and the blocks
dequantized by the same `lockstep.kernels.dequantize` the serving path uses where it has no
kernel, with llama.cpp's transforms undone as at load, so the oracle and the server run on the
same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lockstep.layers.block_weight import BlockWeight
from lockstep.model_loader.layout import TENSOR_INDEX
from lockstep.model_loader.source import CONVERSION_MARKER
from lockstep.model_loader.weights import iter_gguf_weights


def gguf_of(model_dir: Path) -> Path | None:
    """The GGUF a cache entry describes, or None for an HF directory."""
    model_dir = Path(model_dir)
    if not (model_dir / TENSOR_INDEX).is_file():
        return None
    return Path(json.loads((model_dir / CONVERSION_MARKER).read_text())["source"])


def float_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """{HF name: float32 tensor} of a GGUF cache entry's weights, dequantized."""
    gguf_path = gguf_of(model_dir)
    if gguf_path is None:
        raise ValueError(f"{model_dir}: not a GGUF cache entry")
    state = {}
    for name, w in iter_gguf_weights(gguf_path, Path(model_dir) / TENSOR_INDEX):
        state[name] = w.dequantize() if isinstance(w, BlockWeight) else w
    return state


def hf_float_model(model_dir: Path, dtype: torch.dtype = torch.float32,
                   attn_implementation: str = "eager") -> torch.nn.Module:
    """An eval-mode AutoModelForCausalLM with the float weights of `model_dir`. The oracle runs
    eager attention, which applies sliding windows and soft-capping exactly as written."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if gguf_of(model_dir) is None:
        return AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation=attn_implementation).eval()
    config = AutoConfig.from_pretrained(str(model_dir))
    config._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(float_state_dict(model_dir), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"{model_dir}: weights do not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    return model.eval()

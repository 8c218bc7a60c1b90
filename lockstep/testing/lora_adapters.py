"""Random-weight PEFT LoRA adapters for tests and benchmarks, written by peft itself (so the
files are what PEFT writes), and HF transformers + PEFT as their oracle."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from lockstep.lora.adapter import TARGET_MODULES
from lockstep.testing.hf_weights import hf_float_model


def make_peft_adapter(model_dir: Path, out_dir: Path, *, seed: int, rank: int = 8, alpha: float = 16,
                      targets: Sequence[str] = TARGET_MODULES, use_rslora: bool = False,
                      scale: float = 1.0) -> Path:
    """Save a LoRA adapter of `model_dir` with random A and B (B non-zero, unlike PEFT's
    initialization, so it changes the outputs), B multiplied by `scale`."""
    from peft import LoraConfig, get_peft_model

    base = hf_float_model(model_dir)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                     use_rslora=use_rslora, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def peft_model(model_dir: Path, adapter_dir: Path, base: torch.nn.Module | None = None) -> torch.nn.Module:
    """A fresh float32 HF model of `model_dir` (or `base`) with the adapter applied by PEFT."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(base if base is not None else hf_float_model(model_dir),
                                      str(adapter_dir))
    return model.eval()

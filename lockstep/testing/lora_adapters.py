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


def random_adapter(model_cfg, out_dir: Path, *, seed: int, rank: int = 16, alpha: float = 32,
                   targets: Sequence[str] = TARGET_MODULES, b_std: float = 0.01) -> Path:
    """A PEFT-format adapter directory for a model of `model_cfg` (lockstep's ModelConfig) written
    directly, without loading the model: for benchmarks on packaged (GGUF) models."""
    import json

    from safetensors.torch import save_file

    c = model_cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
              "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for m in targets:
            n_in, n_out = shapes[m]
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * b_std
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
         "lora_dropout": 0.0, "bias": "none"}))
    return out


def write_gguf_lora(adapter_dir: Path, arch: str, model_cfg, out: Path, f16: bool = False) -> Path:
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf writes it: `<gguf name>.lora_a` and
    `.lora_b`, Llama's q/k rows permuted as llama.cpp permutes them (on B), adapter.lora.alpha."""
    import json

    import gguf
    from safetensors.torch import load_file

    from lockstep.lora.adapter import _KEY
    from lockstep.testing.gguf_writer import GGUF_ARCH, _permute

    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], model_cfg.num_layers)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[GGUF_ARCH[arch]])
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    for key, t in sorted(load_file(str(Path(adapter_dir) / "adapter_model.safetensors")).items()):
        m = _KEY.search(key)
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        base = names.get_name(f"model.layers.{layer}.{part}.{module}")
        a = t.float().numpy()
        if ab == "B" and arch == "llama" and module in ("q_proj", "k_proj"):
            a = _permute(a, model_cfg.num_heads if module == "q_proj" else model_cfg.num_kv_heads)
        w.add_tensor(f"{base}.weight.lora_{ab.lower()}", a.astype("float16" if f16 else "float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)

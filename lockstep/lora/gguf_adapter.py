"""llama.cpp's LoRA adapter files: the GGUF that its convert_lora_to_gguf script writes from a
PEFT directory (general.type "adapter", adapter.type "lora", adapter.lora.alpha; per adapted
weight `<gguf name>.lora_a` [r, in] and `.lora_b` [out, r], F32, F16, BF16 or Q8_0). As for a
base GGUF, llama.cpp's q/k row permutation of Llama is undone (on B: the permuted dimension is
the output rows), and the scale is llama.cpp's: alpha / r (1 where alpha is 0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lockstep.lora.adapter import TARGET_MODULES, AdapterError, LoraAdapter, LoraConfig


def is_gguf(path: str) -> bool:
    return Path(path).is_file() and Path(path).suffix == ".gguf"


def read_gguf_lora(name: str, path: str, arch: str, num_layers: int, n_heads: int,
                   n_kv_heads: int) -> LoraAdapter:
    import gguf

    from lockstep.model_loader.gguf_loader import hf_tensor_name
    from lockstep.model_loader.weights import _unpermute_rows

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file is the client's 400
        raise AdapterError(f"LoRA adapter {name!r}: {path} is not a GGUF file ({e})") from e

    def field(key: str) -> object:
        f = reader.get_field(key)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise AdapterError(f"LoRA adapter {name!r}: {path} is a GGUF but not a LoRA adapter "
                           f"(general.type {field('general.type')!r}, adapter.type {field('adapter.type')!r})")
    if (file_arch := field("general.architecture")) != arch:
        raise AdapterError(f"LoRA adapter {name!r}: {path} is for {file_arch!r}, the model is {arch!r}")
    alpha = float(field("adapter.lora.alpha") or 0.0)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base, _, ab = t.name.rpartition(".")
        hf = hf_tensor_name(arch, base) if ab in ("lora_a", "lora_b") else None
        module = hf.split(".")[-2] if hf else None
        if module not in TARGET_MODULES:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {t.name!r} is not a LoRA weight of "
                               f"{', '.join(TARGET_MODULES)}")
        layer = int(hf.split(".")[2])
        if layer >= num_layers:
            raise AdapterError(f"LoRA adapter {name!r}: {t.name!r} is for layer {layer}; the model has {num_layers}")
        shape = [int(d) for d in reversed(t.shape)]  # ggml lists dims fastest-first
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        parts.setdefault((layer, module), {})[ab] = torch.from_numpy(values.copy())
    ranks = {ab["lora_a"].shape[0] for ab in parts.values() if "lora_a" in ab}
    if len(ranks) != 1:
        raise AdapterError(f"LoRA adapter {name!r}: {path} has tensors of ranks {sorted(ranks)}; "
                           "one rank per adapter is served")
    rank = ranks.pop()
    config = LoraConfig(rank, alpha, False, frozenset(module for _, module in parts))
    scale = alpha / rank if alpha else 1.0
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"lora_a", "lora_b"} or ab["lora_b"].shape[1] != rank:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_a or "
                               f"lora_b, or its lora_b is not of rank {rank}")
        b = ab["lora_b"]
        if arch == "llama" and module in ("q_proj", "k_proj"):
            b = b[_unpermute_rows(b.shape[0], n_heads if module == "q_proj" else n_kv_heads)]
        weights[(layer, module)] = (ab["lora_a"].contiguous(), (b * scale).contiguous())
    if not weights:
        raise AdapterError(f"LoRA adapter {name!r}: {path} holds no LoRA weights")
    return LoraAdapter(name, str(path), config, weights)

"""Tiny GGUF files written from a tiny HF model (``tiny_models.tiny_hf_model``), as llama.cpp's
``convert_hf_to_gguf.py`` would write them: its tensor names (``gguf.get_tensor_name_map``), its
transforms (llama's q/k permutation, Gemma's norm + 1, llama3's ``rope_freqs``) and the tiny
tokenizer's vocabulary and merges. Loading one back (blocks dequantized) must reproduce the HF
weights, so the loader's GGUF path is tested without downloading anything.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from lockstep.testing.tiny_models import SPECIAL_TOKENS, tiny_tokenizer_dir

QTYPE = gguf.GGMLQuantizationType
GGUF_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
}


@functools.cache
def _tiny_vocab() -> tuple[list[str], list[str]]:
    """(tokens in id order, merges as "a b") of the tiny tokenizer."""
    bpe = json.loads((tiny_tokenizer_dir() / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(bpe["vocab"].items(), key=lambda kv: kv[1])]
    # tokenizers >= 0.20 stores a merge as a pair, older ones as "a b"; GGUF wants "a b"
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    return tokens, merges


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    grouped = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return grouped.swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(config) -> np.ndarray:  # type: ignore[no-untyped-def]
    # the divisors llama.cpp stores, derived from transformers' own llama3 rope
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    theta, dim = config.rope_parameters["rope_theta"], config.head_dim
    plain = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return (plain / scaled.double()).float().numpy()


def _blocks(a: np.ndarray, kind: QTYPE, name: str) -> np.ndarray:
    """`a` in `kind`'s blocks: gguf.quants' own quantizer where it has one (F16, BF16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, ...); for the types it only decodes (the K-quants, the IQ types) seeded random
    blocks with weight-sized scales (lockstep.testing.kernels.random_blocks): such a tensor is not
    `a`, so the file is a model of its own, and tests compare it with HF on its dequantized weights."""
    try:
        return gguf.quants.quantize(a, kind)
    except NotImplementedError:
        from lockstep.testing.kernels import random_blocks

        seed = int.from_bytes(name.encode()[-4:], "little")
        return random_blocks(kind.name, a.shape[0], a.shape[1], seed=seed).numpy()


def write_gguf(model: torch.nn.Module, arch: str, path: Path, *, quantize: bool = False,
               chat_template: str | None = None,
               qtype_of: Callable[[str], QTYPE | None] | None = None) -> Path:
    """Write ``model`` (a tiny HF model of ``arch``) to ``path``. quantize: matrices in Q8_0, the
    embedding in F16; qtype_of(gguf name) -> a GGMLQuantizationType (or None: float32) chooses
    per matrix instead (see _blocks for the types gguf.quants cannot quantize)."""
    cfg = model.config
    tokens, merges = _tiny_vocab()
    if cfg.vocab_size != len(tokens):
        raise ValueError(f"vocab_size {cfg.vocab_size}: the tiny tokenizer has {len(tokens)}")
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[GGUF_ARCH[arch]])
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    w.add_unk_token_id(tokens.index("<unk>"))
    if chat_template:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        gname = f"{names.get_name(base)}.{suffix}"
        a = t.float().numpy()
        if arch == "llama" and ".attn_q." in gname:
            a = _permute(a, cfg.num_attention_heads)
        if arch == "llama" and ".attn_k." in gname:
            a = _permute(a, cfg.num_key_value_heads)
        if arch == "gemma3" and gname.endswith("norm.weight"):
            a = a + np.float32(1)
        kind = None
        if quantize and a.ndim == 2:
            kind = QTYPE.F16 if "token_embd" in gname else QTYPE.Q8_0
        elif qtype_of is not None and a.ndim == 2:
            kind = qtype_of(gname)
        if kind is not None:
            w.add_tensor(gname, _blocks(a, kind, gname), raw_dtype=kind)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

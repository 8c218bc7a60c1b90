"""Tiny GGUF files written from a tiny HF model (``tiny_models.tiny_hf_model``), as llama.cpp's
``convert_hf_to_gguf.py`` would write them: its tensor names (``gguf.get_tensor_name_map``), its
transforms (llama's q/k permutation, Gemma's norm + 1, llama3's ``rope_freqs``) and the tiny
tokenizer's vocabulary and merges. Loading one back (blocks dequantized) must reproduce the HF
weights, so the loader's GGUF path is tested without downloading anything. `write_bert_gguf`
converts an HF BERT directory (``tiny_encoders.make_tiny_encoder``) as the converter's BertModel
does: the one place the tests hold llama.cpp's BERT names, keys and phantom-space vocabulary.
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
               qtype_of: Callable[[str], QTYPE | None] | None = None,
               pooling_type: gguf.PoolingType | None = None) -> Path:
    """Write ``model`` (a tiny HF model of ``arch``) to ``path``. quantize: matrices in Q8_0, the
    embedding in F16; qtype_of(gguf name) -> a GGMLQuantizationType (or None: float32) chooses
    per matrix instead (see _blocks for the types gguf.quants cannot quantize); pooling_type: the
    key the converter writes from a sentence-transformers directory (Qwen3-Embedding's LAST)."""
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
    if pooling_type is not None:
        w.add_pooling_type(pooling_type)
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
    return _finish(w, path)


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    """Writes what `w` holds to its file, in GGUF's order (header, key-values, tensors)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# convert_hf_to_gguf.py's _try_set_pooling_type: 1_Pooling/config.json's flag -> the pooling key
_POOLING_TYPES = {"pooling_mode_mean_tokens": gguf.PoolingType.MEAN,
                  "pooling_mode_cls_token": gguf.PoolingType.CLS,
                  "pooling_mode_lasttoken": gguf.PoolingType.LAST}


def _phantom(token: str, kind: gguf.TokenType) -> str:
    # convert_hf_to_gguf.py BertModel.set_vocab's phantom(): llama.cpp marks word starts, not
    # continuations
    if kind == gguf.TokenType.CONTROL:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def _bert_vocab(tokenizer: dict, n_vocab: int) -> tuple[list[str], list[gguf.TokenType]]:
    """(tokens, types) by id as get_vocab_base gives them: special added tokens are CONTROL, ids
    without a token are "[PAD{i}]" UNUSED, the rest NORMAL; then the phantom spaces."""
    by_id = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    special = {a["id"] for a in tokenizer["added_tokens"] if a["special"]}
    by_id.update({a["id"]: a["content"] for a in tokenizer["added_tokens"]})
    tokens, types = [], []
    for i in range(n_vocab):
        kind = (gguf.TokenType.UNUSED if i not in by_id else
                gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        tokens.append(_phantom(by_id.get(i, f"[PAD{i}]"), kind))
        types.append(kind)
    return tokens, types


def write_bert_gguf(model_dir: Path, path: Path, *, qtype: QTYPE | None = None) -> Path:
    """The GGUF llama.cpp's converter writes from the HF BERT directory `model_dir`: its
    hyper-parameters (bidirectional), the pooling its modules.json names, the phantom-space
    vocabulary, the special ids and normalizer flags of its tokenizer files, and its tensors minus
    the pooler. qtype: the matrices (token_embd too, not positions or segments) in those blocks,
    as ``--outtype q8_0`` writes them; else float32."""
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    w.add_name(model_dir.name)
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    if (model_dir / "modules.json").is_file():
        modules = json.loads((model_dir / "modules.json").read_text())
        pooling = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
        flags = json.loads((model_dir / pooling / "config.json").read_text())
        w.add_pooling_type(next(t for f, t in _POOLING_TYPES.items() if flags.get(f)))
    w.add_token_type_count(cfg.get("type_vocab_size", 1))
    tokens, types = _bert_vocab(tokenizer, cfg["vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    # gguf.SpecialVocab: BERT's [CLS] is the BOS id, its [SEP] the EOS and separator ids
    w.add_bos_token_id(ids[tok_config["cls_token"]])
    w.add_eos_token_id(ids[tok_config["sep_token"]])
    w.add_unk_token_id(ids[tok_config["unk_token"]])
    w.add_sep_token_id(ids[tok_config["sep_token"]])
    w.add_pad_token_id(ids[tok_config["pad_token"]])
    w.add_mask_token_id(ids[tok_config["mask_token"]])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    normalizer = tokenizer["normalizer"]  # gguf.SpecialVocab._parse_normalizer, BertNormalizer
    if normalizer.get("lowercase") is not None:
        w.add_bool("tokenizer.ggml.normalizer.lowercase", normalizer["lowercase"])
    if normalizer.get("strip_accents") is not None:
        w.add_bool("tokenizer.ggml.normalizer.strip_accents", normalizer["strip_accents"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_layers)
    for name, a in load_file(str(model_dir / "model.safetensors")).items():
        name = name.removeprefix("bert.")
        if name.startswith(("pooler.", "embeddings.position_ids")):
            continue  # BertModel.filter_tensors: embeddings need no pooler
        base, suffix = name.rsplit(".", 1)
        gname = f"{names.get_name(base)}.{suffix}"
        a = a.astype(np.float32)
        if qtype is not None and a.ndim == 2 and not gname.startswith(("position_embd", "token_types")):
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    return _finish(w, path)

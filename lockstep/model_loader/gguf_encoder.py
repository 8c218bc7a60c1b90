"""What a GGUF says about embedding, for gguf_loader: llama.cpp's `bert` architecture (its config
and WordPiece tokenizer) and the `<arch>.pooling_type` key any architecture may carry.

- BERT's hyper-parameters are `bert.*` keys; the activation is not recorded (llama.cpp hard-codes
  GELU for BERT), so it is HF's "gelu", the one every BertModel checkpoint names.
- llama.cpp's converter (convert_hf_to_gguf.py, BertModel.set_vocab) writes the WordPiece vocabulary
  in "phantom space" form: a control token ([CLS], [SEP] ...) as it is, a continuation piece
  ("##ing") without its "##", any other piece with a leading "▁". `wordpiece_vocab` inverts that
  exactly; transformers' BertTokenizer then builds BERT's pipeline over it, lowercasing and
  stripping accents as `tokenizer.ggml.normalizer.*` say (llama.cpp's defaults where absent).
- A pooling key becomes a sentence-transformers `modules.json` (Pooling, then Normalize: llama.cpp
  normalizes embeddings by default) in the converted directory, so `pooling.py` decides the
  model's kind from it as from an HF directory: a decoder with one embeds without
  `--is-embedding`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lockstep.model_loader.layout import ModelLoadError

logger = logging.getLogger(__name__)

PHANTOM_SPACE = "\u2581"
_CONTROL = 3  # gguf.TokenType.CONTROL
# gguf.PoolingType -> 1_Pooling/config.json's flag (NONE = 0 and RANK = 4 pool no vector)
_POOLING_FLAGS = {1: "pooling_mode_mean_tokens", 2: "pooling_mode_cls_token",
                  3: "pooling_mode_lasttoken"}


class Metadata(Protocol):
    """gguf_loader's view of a GGUF's key-value metadata."""

    path: Path
    arch: str

    def get(self, key: str, default: Any = None) -> Any: ...
    def arch_get(self, key: str, default: Any = None) -> Any: ...
    def require(self, key: str) -> Any: ...


def f32(value: Any) -> float:
    """A GGUF float32 as the value the model's authors wrote (1e-06, not 9.99999997e-07): its
    shortest repr, so a converted config reads like the original."""
    return float(str(np.float32(value)))


def bert_config_fields(meta: Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """BertConfig's fields for a `bert` GGUF."""
    types = tensors.get("token_types.weight")
    return {
        "architectures": ["BertModel"],
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),  # ggml: [hidden, vocab]
        "hidden_size": int(meta.require("embedding_length")),
        "intermediate_size": int(meta.require("feed_forward_length")),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": int(meta.require("attention.head_count")),
        "max_position_embeddings": int(meta.require("context_length")),
        "type_vocab_size": int(types.shape[-1]) if types is not None else 0,
        "layer_norm_eps": f32(meta.require("attention.layer_norm_epsilon")),
        "hidden_act": "gelu",
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def wordpiece_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """HF's WordPiece vocabulary from llama.cpp's phantom-space token list (the inverse of
    BertModel.set_vocab's `phantom`)."""
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != _CONTROL:
            tok = tok[1:] if tok.startswith(PHANTOM_SPACE) else "##" + tok
        vocab.setdefault(tok, i)
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{len(tokens) - len(vocab)} tokens of the vocabulary collide once "
                             "their phantom spaces are undone")
    return vocab


def wordpiece_tokenizer(meta: Metadata) -> Any:
    """transformers' BertTokenizer over the GGUF's vocabulary and normalizer settings."""
    from transformers import BertTokenizer

    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type")
    if not tokens or not types or len(tokens) != len(types):
        raise ModelLoadError(f"{meta.path}: a bert GGUF needs tokenizer.ggml.tokens and token_type")
    vocab = wordpiece_vocab(list(tokens), list(types))

    def special(key: str, fallback: str | None = None) -> str:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None and fallback:
            token_id = meta.get(f"tokenizer.ggml.{fallback}_token_id")
        if token_id is None or not 0 <= int(token_id) < len(tokens):
            raise ModelLoadError(f"{meta.path}: no valid tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)]

    # llama.cpp lowercases unless told not to, and strips accents as it lowercases (llama-vocab.cpp)
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    return BertTokenizer(
        vocab=vocab, do_lower_case=lowercase,
        strip_accents=bool(meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase)),
        unk_token=special("unknown"), pad_token=special("padding"), mask_token=special("mask"),
        # the GGUF names [CLS] only as BOS, and [SEP] as the separator and EOS
        cls_token=special("cls", "bos"), sep_token=special("seperator", "eos"),
        model_max_length=int(meta.arch_get("context_length", 512)))


def write_pooling_modules(meta: Metadata, out_dir: Path) -> None:
    """modules.json, 1_Pooling/config.json for the GGUF's pooling key, if it pools a vector."""
    kind = meta.arch_get("pooling_type")
    if kind is None:
        return
    if (flag := _POOLING_FLAGS.get(int(kind))) is None:
        logger.warning("%s: %s.pooling_type %s pools no vector; the key is ignored",
                       meta.path, meta.arch, kind)
        return
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({flag: True}) + "\n")
    modules = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{t}"}
               for i, (path, t) in enumerate((("", "Transformer"), ("1_Pooling", "Pooling"),
                                              ("2_Normalize", "Normalize")))]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=1) + "\n")

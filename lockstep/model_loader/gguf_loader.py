"""Describe a GGUF checkpoint once, for every later start (parsing a 262k vocabulary takes ~17 s):
an HF config, a fast tokenizer and `gguf_tensors.json`, which maps each HF parameter to its bytes
in the GGUF (offset, length, GGML type, HF shape) and the transform undoing llama.cpp's (Gemma's
norm + 1, Llama's q/k permutation); `weights.py` memory-maps them, in their quantized blocks.
Hyper-parameters the GGUF leaves implicit take the value llama.cpp hard-codes for the family.
BERT encoders are one more architecture here; what is theirs alone (the WordPiece vocabulary) and
the pooling key any GGUF may carry are gguf_encoder's."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from lockstep.model_loader.gguf_encoder import (
    bert_config_fields,
    f32,
    wordpiece_tokenizer,
    write_pooling_modules,
)
from lockstep.model_loader.layout import TENSOR_INDEX, ModelLoadError
from lockstep.model_loader.stop_tokens import END_OF_TURN_TOKENS

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
# Gemma 3 also norms each sub-layer's output, so llama.cpp's ffn_norm is the *pre*-FFN norm there.
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# BERT (llama.cpp's `bert`, written from a BertModel: its pooler is dropped)
_BERT_GLOBAL_NAMES = {"token_embd": "embeddings.word_embeddings",
                      "token_types": "embeddings.token_type_embeddings",
                      "position_embd": "embeddings.position_embeddings",
                      "token_embd_norm": "embeddings.LayerNorm"}
_BERT_LAYER_NAMES = {
    "attn_q": "attention.self.query", "attn_k": "attention.self.key",
    "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
# arch -> (global names, per-layer names, the HF prefix of layer N)
_NAMES = {"bert": (_BERT_GLOBAL_NAMES, _BERT_LAYER_NAMES, "encoder.layer.{}."),
          "gemma3": (_GLOBAL_NAMES, _GEMMA3_LAYER_NAMES, "model.layers.{}.")}
_DECODER_NAMES = (_GLOBAL_NAMES, _LAYER_NAMES, "model.layers.{}.")
# The GGUF architectures supported, and the HF class of each.
_HF_ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM",
                     "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "bert": "BertModel"}


def hf_tensor_name(arch: str, gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None if `arch` has no such tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    global_names, table, layer_prefix = _NAMES.get(arch, _DECODER_NAMES)
    if base in global_names:
        return f"{global_names[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in table:
        return f"{layer_prefix.format(parts[1])}{table[parts[2]]}.{suffix}"
    return None


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, the tensor index and tokenizer files into
    `out_dir`; `resolve_model` has checked the file starts as a GGUF."""
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # gguf reports truncation as reshape / index errors deep in numpy
        size = gguf_path.stat().st_size
        raise ModelLoadError(
            f"{gguf_path}: truncated or corrupt GGUF file ({size} bytes): {e}") from e
    meta = _Metadata(reader, gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    config = build_config(meta, tensors)
    logger.info("indexing %s (%s, %d tensors) into %s", gguf_path, meta.arch, len(tensors), out_dir)
    index = _tensor_index(reader, meta, config)
    _check_shapes(index, config, gguf_path)
    (out_dir / TENSOR_INDEX).write_text(json.dumps(
        {"gguf_size": gguf_path.stat().st_size, "tensors": index}, indent=1) + "\n")
    config.save_pretrained(str(out_dir))
    _write_tokenizer(gguf_path, meta, config, out_dir)
    write_pooling_modules(meta, out_dir)


class _Metadata:
    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._reader = reader
        self.path = path
        arch = self.get("general.architecture")
        if arch not in _HF_ARCHITECTURES:
            raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                                 f"(supported: {', '.join(_HF_ARCHITECTURES)})")
        self.arch: str = arch

    def get(self, key: str, default: Any = None) -> Any:
        if (field := self._reader.fields.get(key)) is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelLoadError(f"{self.path}: unreadable metadata {key!r}: {e}") from e

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        if (value := self.arch_get(key)) is None:
            raise ModelLoadError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value


def _rope(meta: _Metadata, default_theta: float) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default",
                              "rope_theta": f32(meta.arch_get("rope.freq_base", default_theta))}
    kind = meta.arch_get("rope.scaling.type")
    if kind in ("linear", "yarn"):
        params.update(rope_type=kind, factor=f32(meta.require("rope.scaling.factor")))
        original = meta.arch_get("rope.scaling.original_context_length")
        if kind == "yarn" and original:
            params["original_max_position_embeddings"] = int(original)
    elif kind not in (None, "none"):
        raise ModelLoadError(f"{meta.path}: unsupported rope scaling type {kind!r}")
    return params


def _llama3_rope(freqs: np.ndarray, theta: float, rope_dim: int) -> dict[str, Any] | None:
    """HF's llama3 rope parameters from the per-frequency divisors llama.cpp stores in
    `rope_freqs` (Llama 3.1+): low/high_freq_factor are Meta's 1 and 4 in every such checkpoint,
    the factor is the largest divisor, the original context follows from any interpolated one."""
    freqs = freqs.astype(np.float64)
    factor = float(f"{freqs.max():.5g}")  # the plateau is the factor itself, up to float32 noise
    if factor <= 1.0:
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, rope_dim, 2) / rope_dim)
    smooth = (1 / freqs - 1 / factor) / (1 - 1 / factor)
    middle = (freqs > 1 + 1e-6) & (freqs < factor - 1e-6)
    candidates = [round(float(w * (3 * s + 1))) for w, s in zip(wavelen[middle], smooth[middle])]
    for original in [*candidates[:1], 8192]:
        s = (original / wavelen - 1.0) / 3.0
        expected = np.where(wavelen < original / 4.0, 1.0,
                            np.where(wavelen > original, factor, 1 / ((1 - s) / factor + s)))
        if np.allclose(expected, freqs, rtol=1e-4):
            return {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": original}
    return None


def build_config(meta: _Metadata, tensors: dict[str, ReaderTensor]) -> Any:
    """The transformers config object for this GGUF, built by transformers' own config class."""
    from transformers import AutoConfig

    arch = meta.arch
    if (embed := tensors.get("token_embd.weight")) is None:
        raise ModelLoadError(f"{meta.path}: no token_embd.weight tensor")
    if arch == "bert":
        return AutoConfig.for_model("bert", **bert_config_fields(meta, tensors))
    hidden = int(meta.require("embedding_length"))
    n_layers = int(meta.require("block_count"))
    n_heads = int(meta.require("attention.head_count"))
    n_kv = meta.arch_get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer counts; the architectures here use one count
        if len(set(n_kv)) != 1:
            raise ModelLoadError(f"{meta.path}: per-layer KV head counts {n_kv} not supported")
        n_kv = n_kv[0]
    head_dim = meta.arch_get("attention.key_length") or meta.arch_get("rope.dimension_count")
    head_dim = int(head_dim or hidden // n_heads)
    common: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "vocab_size": int(embed.shape[-1]),  # ggml lists dims fastest-first: [hidden, vocab]
        "hidden_size": hidden, "intermediate_size": int(meta.require("feed_forward_length")),
        "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv), "head_dim": head_dim,
        "max_position_embeddings": int(meta.require("context_length")),
        "rms_norm_eps": f32(meta.require("attention.layer_norm_rms_epsilon")),
        # llama.cpp drops output.weight when it is the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "gemma3":
        return AutoConfig.for_model("gemma3_text", **common, **_gemma3_extras(meta, common))
    rope = _rope(meta, 10000.0)
    if "rope_freqs.weight" in tensors:
        rope_dim = int(meta.arch_get("rope.dimension_count") or head_dim)
        stored = tensors["rope_freqs.weight"]
        freqs = np.asarray(dequantize(stored.data, stored.tensor_type))
        rope = _llama3_rope(freqs, rope["rope_theta"], rope_dim) or rope
        if rope["rope_type"] != "llama3":  # transformers ignores rope_freqs altogether
            logger.warning("%s: rope_freqs is not llama3 rope scaling; ignoring it", meta.path)
    # Qwen2's q/k/v biases are built into its architecture; the others say so in the config.
    extras = {} if arch == "qwen2" else {"attention_bias": "blk.0.attn_q.bias" in tensors}
    return AutoConfig.for_model(arch, **common, **extras, rope_parameters=rope)


def _gemma3_extras(meta: _Metadata, common: dict[str, Any]) -> dict[str, Any]:
    n_layers = common["num_hidden_layers"]
    pattern = meta.arch_get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer converters: one bool per layer, True = sliding
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's built-in Gemma 3 pattern: every 6th layer attends globally
        period = int(pattern or 6)
        sliding = [(i + 1) % period != 0 for i in range(n_layers)]
    extras: dict[str, Any] = {
        "sliding_window": int(meta.require("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (62 layers), which
        # uses hidden_size / num_heads, as its HF config's query_pre_attn_scalar does.
        "query_pre_attn_scalar": (common["hidden_size"] // common["num_attention_heads"]
                                  if n_layers == 62 else common["head_dim"]),
        "rope_parameters": {
            "full_attention": _rope(meta, 1_000_000.0),
            # GGUF rarely records the local base; llama.cpp hard-codes Gemma 3's 10k.
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": f32(meta.arch_get("rope.freq_base_swa", 10000.0))},
        },
    }
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if (value := meta.arch_get(key)) is not None:
            extras[key] = f32(value)
    return extras


def _tensor_index(reader: GGUFReader, meta: _Metadata, config: Any) -> dict[str, dict[str, Any]]:
    """{HF name: where its bytes are in the GGUF, their GGML type, the HF shape, the transform}."""
    arch, path = meta.arch, meta.path
    index: dict[str, dict[str, Any]] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # folded into rope_parameters by build_config
            continue
        if (hf_name := hf_tensor_name(arch, t.name)) is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for a {arch} model")
        transform: list[Any] | None = None
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            # Gemma computes x * (1 + w); llama.cpp stores 1 + w, HF stores w.
            transform = ["minus_one"]
        elif arch == "llama" and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            q = ".q_proj." in hf_name
            transform = ["unpermute", config.num_attention_heads if q else config.num_key_value_heads]
        index[hf_name] = {
            "gguf": t.name, "qtype": t.tensor_type.name,
            "shape": [int(d) for d in reversed(t.shape)],  # ggml lists dims fastest-first
            "offset": int(t.data_offset), "nbytes": int(t.n_bytes), "transform": transform}
    return index


def _check_shapes(index: dict[str, dict[str, Any]], config: Any, gguf_path: Path) -> None:
    """Every tensor the model class wants, in the shape it wants (read off a weightless,
    meta-device instance), and no other."""
    from transformers import AutoModel, AutoModelForCausalLM

    encoder = config.model_type == "bert"
    with torch.device("meta"):
        model = (AutoModel if encoder else AutoModelForCausalLM).from_config(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()
                if not (encoder and name.startswith("pooler."))}  # llama.cpp drops the pooler
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for name, entry in index.items():
        want = expected.get(name)
        if want is None or tuple(entry["shape"]) != want:
            raise ModelLoadError(f"{gguf_path}: tensor {name} has shape "
                                 f"{tuple(entry['shape'])}, the model expects {want}")
    if missing := sorted(set(expected) - set(index)):
        raise ModelLoadError(f"{gguf_path}: missing tensors {missing[:5]} ({len(missing)} in all)")


def _write_tokenizer(gguf_path: Path, meta: _Metadata, config: Any, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        if meta.get("tokenizer.ggml.model") == "bert":  # transformers reads no WordPiece GGUF
            tok = wordpiece_tokenizer(meta)
        else:
            tok = (_tokenizer_class(config) or AutoTokenizer).from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from its metadata: {e}") from e
    template = meta.get("tokenizer.chat_template")
    if template and not tok.chat_template:
        tok.chat_template = template
    tok.save_pretrained(str(out_dir))
    if not _reloads_identically(tok, out_dir):
        # Some classes rebuild their pipeline on load (GemmaTokenizer forces SentencePiece-style
        # spaces even onto a byte-level vocabulary); the generic class takes tokenizer.json as is.
        config_path = out_dir / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text())
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
        if not _reloads_identically(tok, out_dir):
            raise ModelLoadError(f"{gguf_path}: converted tokenizer does not reload identically")
    _write_generation_config(meta, config, tok.get_vocab(), out_dir)


def _reloads_identically(tok: Any, out_dir: Path) -> bool:
    from transformers import AutoTokenizer

    specials = "".join(tok.all_special_tokens)
    probes = ["Hello world", "  two  spaces\n\ttab", "naïve 東京 🙂", specials]
    reloaded = AutoTokenizer.from_pretrained(str(out_dir))
    return all(reloaded(p).input_ids == tok(p).input_ids for p in probes)


def _write_generation_config(meta: _Metadata, config: Any, vocab: dict[str, int],
                             out_dir: Path) -> None:
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    found = [config.eos_token_id, meta.get("tokenizer.ggml.eot_token_id"),
             meta.get("tokenizer.ggml.eom_token_id"), *(vocab.get(t) for t in END_OF_TURN_TOKENS)]
    eos = list(dict.fromkeys(int(token_id) for token_id in found if token_id is not None))
    if eos:
        generation.eos_token_id = eos if len(eos) > 1 else eos[0]
    generation.save_pretrained(str(out_dir))


def _tokenizer_class(config: Any) -> Any:
    """The tokenizer class AutoTokenizer picks for this config, without AutoTokenizer(gguf_file=)
    re-reading the whole GGUF to learn the model type (~25 s for a 262k vocabulary)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    try:
        cls = TOKENIZER_MAPPING[type(config)]
    except KeyError:
        return None
    if isinstance(cls, tuple):  # transformers 4: (slow, fast)
        cls = cls[1] or cls[0]
    return cls

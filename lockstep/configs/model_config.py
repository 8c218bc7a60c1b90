"""The model's shape, read once from an HF config.json dict (old and transformers-5 formats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lockstep.configs.vision_config import VisionConfig

ARCH_BY_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "gemma3_text": "gemma3", "gemma3": "gemma3", "bert": "bert",
                      "roberta": "bert", "xlm-roberta": "bert"}
# BERT-family types whose positions start past the padding id (RoBERTa's
# create_position_ids_from_input_ids: padding_idx + 1 for the first token)
POSITIONS_AFTER_PADDING = frozenset({"roberta", "xlm-roberta"})


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str
    rope_global: RopeConfig
    # Per-layer sliding window (None = full attention); Gemma 3 interleaves both.
    layer_windows: tuple[int | None, ...]
    rope_local: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Encoders (BERT): every token attends to every token of its request, both ways (models/bert.py
    # reads its own K/V so; the paged attention path stays causal).
    causal: bool = True
    type_vocab_size: int = 0  # BERT's segment (token type) embeddings
    num_labels: int = 0  # a sequence-classification head's outputs (a cross-encoder's score)
    sep_token_id: int | None = None  # BERT: tokens after the first separator are segment 1
    # a yes/no reranker (model_loader.pooling): the tokens whose LM-head rows are its classifier
    label_token_ids: tuple[int, ...] = ()
    position_offset: int = 0  # added to every position id (RoBERTa family: padding id + 1)
    vision: VisionConfig | None = None  # a model that reads images (lockstep.multimodal)

    @property
    def is_gemma(self) -> bool:
        return self.arch == "gemma3"

    @property
    def context_limit(self) -> int:
        """The most positions a request may take: the position table less its offset."""
        return self.max_position - self.position_offset

    @property
    def model_key(self) -> str:
        """The model table's key (lockstep.models.registry): the arch; a model that reads images,
        its vision family + "+vision" (Idefics3's text model is a Llama: the family names it)."""
        return f"{self.vision.family}+vision" if self.vision else self.arch

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        vision = VisionConfig.from_hf(cfg)
        if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
            cfg = _gemma3_text_config(cfg["text_config"])
        elif cfg.get("model_type") == "idefics3":
            cfg = _idefics3_text_config(cfg)
        model_type = cfg.get("model_type", "")
        if model_type not in ARCH_BY_MODEL_TYPE:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                             f"{sorted(ARCH_BY_MODEL_TYPE)}")
        arch = ARCH_BY_MODEL_TYPE[model_type]
        n_heads = cfg["num_attention_heads"]
        n_layers = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope_global, rope_local = _rope_configs(cfg, arch)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        classifier = any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or ())
        return cls(
            arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=n_layers, num_heads=n_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads, head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6)),
            max_position=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=cfg.get("tie_word_embeddings", arch == "gemma3"),
            # Qwen2 always has q/k/v biases; its config does not say so.
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            rope_global=rope_global, rope_local=rope_local,
            layer_windows=_layer_windows(cfg, arch, n_layers),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"), eos_token_ids=eos_ids,
            causal=arch != "bert", type_vocab_size=cfg.get("type_vocab_size", 0),
            num_labels=len(cfg.get("id2label") or {0: 0}) if classifier else 0,
            sep_token_id=cfg.get("sep_token_id"), vision=vision,
            position_offset=(int(cfg.get("pad_token_id", 1)) + 1
                             if model_type in POSITIONS_AFTER_PADDING else 0))


def _gemma3_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3's text_config with transformers' defaults filled in: the released
    checkpoints leave out what equals a default (vocab_size, heads, layer types, RoPE bases), and
    only the config class knows those (and derives the layer types and RoPE as HF runs them)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**text).to_dict()


def _idefics3_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Idefics3's (SmolVLM's) Llama text_config with transformers' defaults filled in (its config
    class knows them: Idefics3Config's text default has rms_norm_eps 1e-5), and the top level's
    tie_word_embeddings, which is the one HF's model ties by."""
    from transformers import Idefics3Config

    full = Idefics3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    text = full.text_config.to_dict()
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    return text


def _rope(params: dict[str, Any], default_theta: float) -> RopeConfig:
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        rope_type=params.get("rope_type", params.get("type", "default")) or "default",
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _rope_configs(cfg: dict[str, Any], arch: str) -> tuple[RopeConfig, RopeConfig | None]:
    gemma = arch == "gemma3"
    params = cfg.get("rope_parameters")
    if gemma and params and "full_attention" in params:
        return _rope(params["full_attention"], 1e6), _rope(params["sliding_attention"], 1e4)
    theta = 1e6 if gemma else 1e4
    if gemma or not params:  # the older format: rope_theta beside rope_scaling
        params = {"rope_theta": cfg.get("rope_theta", theta), **(cfg.get("rope_scaling") or {})}
    local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 1e4))) if gemma else None
    return _rope(params, theta), local


def _layer_windows(cfg: dict[str, Any], arch: str, n_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if arch == "gemma3" and not types:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n_layers)]
    elif arch != "gemma3":
        if not (cfg.get("use_sliding_window") and window):
            return (None,) * n_layers
        types = types or ["sliding_attention"] * n_layers
    return tuple(window if t == "sliding_attention" else None for t in types)

"""A multimodal model's vision side, read once from its HF config.json: the tower's shape, how its
features become prompt tokens, and the token ids images occupy in a prompt. One entry per model
family in `FAMILIES` (Gemma 3: a SigLIP tower pooled and projected; Idefics3 / SmolVLM: a SigLIP-
style tower per tile, pixel-shuffled and projected)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    family: str  # the model family's key ("gemma3", "idefics3"): its model class and its prompt layout
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    tokens_per_image: int  # soft tokens an image (Idefics3: each tile) becomes in the prompt
    image_token_id: int  # the placeholder HF's processor repeats tokens_per_image times
    boi_token_id: int | None = None  # Gemma 3's <start_of_image>: where a prompt's text puts an image
    eoi_token_id: int | None = None
    scale_factor: int = 1  # Idefics3's pixel shuffle: scale_factor**2 patches per token

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionConfig | None:
        """The vision side of a multimodal config; None for a text model."""
        read = FAMILIES.get(cfg.get("model_type", ""))
        v = cfg.get("vision_config")
        return read(cfg, v) if read is not None and v else None


def _gemma3(cfg: dict[str, Any], v: dict[str, Any]) -> VisionConfig:
    return VisionConfig(
        family="gemma3",
        hidden_size=v.get("hidden_size", 768), intermediate_size=v.get("intermediate_size", 3072),
        num_layers=v.get("num_hidden_layers", 12), num_heads=v.get("num_attention_heads", 12),
        image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 16),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        tokens_per_image=cfg.get("mm_tokens_per_image", 256),
        image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 262144)),
        boi_token_id=cfg.get("boi_token_index", 255999), eoi_token_id=cfg.get("eoi_token_index", 256000))


def _idefics3(cfg: dict[str, Any], v: dict[str, Any]) -> VisionConfig:
    # defaults: transformers' Idefics3VisionConfig / Idefics3Config (what a checkpoint leaves out)
    image_size, patch = v.get("image_size", 224), v.get("patch_size", 32)
    scale = cfg.get("scale_factor", 2)
    return VisionConfig(
        family="idefics3",
        hidden_size=v.get("hidden_size", 1152), intermediate_size=v.get("intermediate_size", 3072),
        num_layers=v.get("num_hidden_layers", 12), num_heads=v.get("num_attention_heads", 16),
        image_size=image_size, patch_size=patch, layer_norm_eps=v.get("layer_norm_eps", 1e-6),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        # HF's Idefics3Model.image_seq_len: a tile's patches over the shuffle's scale_factor**2
        tokens_per_image=int((image_size // patch) ** 2 / scale**2),
        image_token_id=cfg.get("image_token_id", 128257), scale_factor=scale)


FAMILIES: dict[str, Callable[[dict[str, Any], dict[str, Any]], VisionConfig]] = {
    "gemma3": _gemma3, "idefics3": _idefics3}

"""A multimodal model's vision side, read once from its HF config.json (Gemma 3's SigLIP tower and
projector): the tower's shape and the token ids its images occupy in a prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    tokens_per_image: int  # soft tokens an image becomes in the prompt (after pooling)
    image_token_id: int  # the placeholder HF's processor repeats tokens_per_image times
    boi_token_id: int  # <start_of_image>: where a prompt's text puts an image
    eoi_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionConfig | None:
        """The vision side of a Gemma3ForConditionalGeneration config; None for a text model."""
        v = cfg.get("vision_config")
        if cfg.get("model_type") != "gemma3" or not v:
            return None
        return cls(
            hidden_size=v.get("hidden_size", 768), intermediate_size=v.get("intermediate_size", 3072),
            num_layers=v.get("num_hidden_layers", 12), num_heads=v.get("num_attention_heads", 12),
            image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 16),
            layer_norm_eps=v.get("layer_norm_eps", 1e-6),
            hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
            tokens_per_image=cfg.get("mm_tokens_per_image", 256),
            image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 262144)),
            boi_token_id=cfg.get("boi_token_index", 255999), eoi_token_id=cfg.get("eoi_token_index", 256000))

"""A released Gemma 3 vision checkpoint's config.json (gemma-3-4b-it's shape: the text config leaves
out what equals transformers' defaults, the vision config leaves out SigLIP's) reads as the model
HF runs, and its image tokens are where HF's processor puts them."""

from __future__ import annotations

from lockstep.configs.model_config import ModelConfig

GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
    "mm_tokens_per_image": 256, "eos_token_id": [1, 106],
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}


def test_released_gemma3_vision_config_reads_with_transformers_defaults():
    cfg = ModelConfig.from_hf(GEMMA3_4B_IT)
    assert cfg.model_key == "gemma3+vision"
    assert (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (262208, 8, 4, 256)
    assert cfg.layer_windows[:6] == (1024,) * 5 + (None,) and len(cfg.layer_windows) == 34
    assert cfg.rope_global.rope_type == "linear" and cfg.rope_global.factor == 8.0
    assert cfg.rope_local is not None and cfg.rope_local.theta == 10000.0
    v = cfg.vision
    assert v is not None and (v.patches_per_side, v.tokens_per_image, v.image_token_id) == (64, 256, 262144)

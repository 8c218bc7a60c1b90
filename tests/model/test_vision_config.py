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


# SmolVLM-256M-Instruct's config.json shape (Idefics3ForConditionalGeneration: a Llama text config
# and a 512-pixel tile tower of 16-pixel patches, pixel-shuffled by 4)
SMOLVLM_256M = {
    "architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3",
    "image_token_id": 49190, "scale_factor": 4, "tie_word_embeddings": False,
    "text_config": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                    "head_dim": 64, "vocab_size": 49280, "max_position_embeddings": 8192,
                    "rms_norm_eps": 1e-5, "rope_theta": 100000, "pad_token_id": 2},
    "vision_config": {"model_type": "idefics3_vision", "hidden_size": 768, "intermediate_size": 3072,
                      "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 512,
                      "patch_size": 16},
}


def test_smolvlm_config_reads_as_idefics3_with_a_llama_text_model():
    cfg = ModelConfig.from_hf(SMOLVLM_256M)
    assert cfg.model_key == "idefics3+vision" and cfg.arch == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (49280, 576, 9, 3, 64)
    assert cfg.rope_global.theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and not cfg.tie_word_embeddings
    v = cfg.vision
    assert v is not None and (v.family, v.patches_per_side, v.scale_factor) == ("idefics3", 32, 4)
    assert (v.tokens_per_image, v.image_token_id) == (64, 49190)  # HF's image_seq_len

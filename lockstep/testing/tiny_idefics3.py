"""A tiny random-weight Idefics3 / SmolVLM (HF's Idefics3ForConditionalGeneration), built locally like
the tiny Gemma 3 vision model (lockstep.testing.tiny_vision): the tiny tokenizer plus Idefics3's
image tokens (<fake_token_around_image>, <image>, <end_of_utterance>, <global-img>, <row_r_col_c>),
a Llama text model, a 32x32-pixel tile tower of 4x4 patches shuffled by 2 to 16 tokens a tile, and
SmolVLM's chat template, and a preprocessor config whose images become 2x2, 2x1 or 1x2 tiles plus the global view (longest
edge 64), so lockstep and HF transformers read the same directory. `hf_idefics3_inputs` is the
oracle's side: HF's Idefics3Processor output for a prompt and its images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lockstep.testing.tiny_models import (
    BOS_ID,
    EOS_ID,
    HEAD_DIM,
    HIDDEN_SIZE,
    INIT_RANGE,
    INTERMEDIATE_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    PAD_ID,
    TINY_VERSION,
    TOKENIZER_VOCAB_SIZE,
    built_tiny_dir,
    mark_fast_tokenizer,
    perturbed_params,
    tiny_tokenizer_dir,
)

FAKE, IMAGE, END_OF_UTTERANCE, GLOBAL = "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"
ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
ADDED = [FAKE, IMAGE, END_OF_UTTERANCE, GLOBAL, *ROW_COL]
IMAGE_ID = TOKENIZER_VOCAB_SIZE + 1
VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + len(ADDED)
TILE, PATCH, SCALE = 32, 4, 2
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // SCALE**2
IDEFICS3_VERSION = "v2"
# SmolVLM-256M/500M-Instruct's own chat template: it reads message content only as typed parts
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def tiny_idefics3_config() -> Any:
    from transformers import Idefics3Config

    text = dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE,
                intermediate_size=INTERMEDIATE_SIZE, num_hidden_layers=3, num_attention_heads=NUM_HEADS,
                num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
                rms_norm_eps=1e-5, initializer_range=INIT_RANGE, bos_token_id=BOS_ID,
                eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    vision = dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, image_size=TILE, patch_size=PATCH,
                  initializer_range=INIT_RANGE)
    return Idefics3Config(text_config=text, vision_config=vision, scale_factor=SCALE,
                          image_token_id=IMAGE_ID, tie_word_embeddings=False, pad_token_id=PAD_ID)


def _build(out: Path, seed: int) -> None:
    from transformers import AutoTokenizer, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(tiny_idefics3_config()).eval()
    with torch.no_grad():
        for _ in perturbed_params(model, seed):
            pass
    model.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))
    tok.add_tokens(ADDED, special_tokens=True)
    assert tok.convert_tokens_to_ids(IMAGE) == IMAGE_ID and len(tok) == VOCAB_SIZE
    tok.chat_template = SMOLVLM_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    Idefics3ImageProcessorPil(max_image_size={"longest_edge": TILE},
                              size={"longest_edge": 2 * TILE}).save_pretrained(str(out))
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Idefics3Processor", "image_seq_len": TOKENS_PER_TILE}, indent=2) + "\n")
    mark_fast_tokenizer(out)


def make_tiny_idefics3_model(seed: int = 0, out_dir: Path | None = None) -> Path:
    """The tiny Idefics3 directory (cached, or written into `out_dir`)."""
    return built_tiny_dir(f"idefics3-s{seed}-{TINY_VERSION}-{IDEFICS3_VERSION}", lambda p: _build(p, seed), out_dir)


def hf_idefics3_processor(model_dir: Path) -> Any:
    """HF's Idefics3Processor for the directory (the PIL image processor, the directory's tokenizer)."""
    from transformers import AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3Processor(image_processor=Idefics3ImageProcessorPil.from_pretrained(str(model_dir)),
                             tokenizer=AutoTokenizer.from_pretrained(str(model_dir)),
                             image_seq_len=TOKENS_PER_TILE)


def hf_idefics3_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, pixel_values and pixel_attention_mask as HF's processor makes them
    (the images of one prompt, several padded to the most tiles)."""
    out = hf_idefics3_processor(model_dir)(text=prompt, images=images, return_tensors="pt")
    return {k: out[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}

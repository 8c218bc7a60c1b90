"""A tiny random-weight Gemma 3 with images (HF's Gemma3ForConditionalGeneration), built locally
like the text tiny models (lockstep.testing.tiny_models): the tiny tokenizer plus Gemma 3's three
image tokens, a 32x32-pixel SigLIP tower of 4x4 patches pooled to 4 tokens an image, and a
preprocessor config, so lockstep and HF transformers read the same directory. `hf_image_inputs`
is the oracle's side: HF's processor output for a prompt and its images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lockstep.testing.tiny_models import (
    GEMMA3_SLIDING_WINDOW,
    HEAD_DIM,
    HIDDEN_SIZE,
    INIT_RANGE,
    INTERMEDIATE_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    TINY_VERSION,
    _gemma3_tweak,
    built_tiny_dir,
    mark_fast_tokenizer,
    perturbed_params,
    tiny_tokenizer_dir,
)

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 4
VISION_VERSION = "v1"


def tiny_vision_config() -> Any:
    from transformers import Gemma3Config

    text = dict(model_type="gemma3_text", vocab_size=515, hidden_size=HIDDEN_SIZE,
                intermediate_size=INTERMEDIATE_SIZE, num_hidden_layers=3, num_attention_heads=NUM_HEADS,
                num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                sliding_window=GEMMA3_SLIDING_WINDOW, query_pre_attn_scalar=16, rms_norm_eps=1e-6,
                initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH,
                  vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                        boi_token_index=512, image_token_index=513, eoi_token_index=514,
                        initializer_range=INIT_RANGE, eos_token_id=2)


def _build(out: Path, seed: int) -> None:
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(tiny_vision_config()).eval()
    with torch.no_grad():
        for name, p in perturbed_params(model, seed):
            _gemma3_tweak(name.replace("model.language_model.", "model."), p)
            if "patch_embedding" in name or "mm_input_projection" in name:
                p.mul_(4.0)  # image features as large as the (shrunk) text embeddings' rows
    model.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))
    tok.add_tokens([BOI, IMAGE, EOI], special_tokens=True)
    assert tok.convert_tokens_to_ids([BOI, IMAGE, EOI]) == [512, 513, 514]
    tok.save_pretrained(str(out))
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(str(out))
    mark_fast_tokenizer(out)


def make_tiny_vision_model(seed: int = 0, out_dir: Path | None = None) -> Path:
    """The tiny Gemma 3 vision model directory (cached, or written into `out_dir`)."""
    return built_tiny_dir(f"gemma3-vision-s{seed}-{TINY_VERSION}-{VISION_VERSION}", lambda p: _build(p, seed), out_dir)


def hf_image_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids and pixel_values as HF's processor makes them."""
    from transformers import AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    full = f"\n\n{BOI}{IMAGE * TOKENS_PER_IMAGE}{EOI}\n\n"
    ids = torch.tensor([tok(prompt.replace(BOI, full)).input_ids])
    px = Gemma3ImageProcessorPil.from_pretrained(str(model_dir))(images=images, return_tensors="pt",
                                                                 do_pan_and_scan=False)["pixel_values"]
    return {"input_ids": ids, "token_type_ids": (ids == 513).long(), "pixel_values": px}


def random_image(seed: int, width: int = 50, height: int = 40) -> Any:
    """A PIL RGB image of seeded noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def data_url(image: Any, fmt: str = "PNG") -> str:
    """`image` as a data URL, as clients send it."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()

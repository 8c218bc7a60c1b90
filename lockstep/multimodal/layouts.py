"""How each model family's images enter a prompt, with the model's own HF processor, one entry per
family in `LAYOUTS` (keyed by VisionConfig.family). A layout says what a prompt's text writes where
an image goes, how the text grows around it before tokenizing, and, per image, its float32 pixels
and its token ids (the image token where features go, and whatever text tokens HF's processor puts
between them), which replace the image's place in the tokenized prompt (processing.py).

- Gemma 3: "<start_of_image>" in the text becomes "\\n\\n<start_of_image>" + tokens_per_image image
  tokens + "<end_of_image>\\n\\n" (as HF's processor; the text is expanded before tokenizing, as
  "\\n\\n" tokenizes with its neighbours); its place is that run of image tokens. One [3, H, W] image.
- Idefics3 / SmolVLM: "<image>" stays one token in the tokenized prompt, its place; HF's processor
  run on that placeholder alone gives the image's tiles [tiles, 3, H, W] and its tokens
  (<fake_token_around_image><row_r_col_c> + image tokens per tile, "\\n" per row, then the global
  view's). The layout begins and ends with special tokens, which the tokenizer splits on, so
  putting it in by ids gives HF's tokens for the whole prompt exactly."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from lockstep.configs.vision_config import VisionConfig


class ImageLayout(Protocol):
    placeholder: str  # what a prompt's text writes where an image goes
    place_tokens: int  # an image's place in the tokenized prompt: a run of this many image tokens
    bidirectional: bool  # an image's tokens see each other (ImageRef.bidirectional)

    def expand_text(self, text: str) -> str:
        """The text as HF's processor writes it before tokenizing (the images' places in it)."""
        ...

    def process(self, image: Image.Image) -> tuple[np.ndarray, list[int]]:
        """One image's float32 pixels and the token ids it takes in the prompt."""
        ...


class Gemma3Layout:
    bidirectional = True

    def __init__(self, vision: VisionConfig, processor: Any, tokenizer: Any) -> None:
        self.vision, self.processor = vision, processor
        self.place_tokens = vision.tokens_per_image
        self.placeholder = tokenizer.convert_ids_to_tokens(vision.boi_token_id)
        self.image_token = tokenizer.convert_ids_to_tokens(vision.image_token_id)
        self.eoi = tokenizer.convert_ids_to_tokens(vision.eoi_token_id)

    def expand_text(self, text: str) -> str:
        full = f"\n\n{self.placeholder}{self.image_token * self.vision.tokens_per_image}{self.eoi}\n\n"
        return text.replace(self.placeholder, full)

    def process(self, image: Image.Image) -> tuple[np.ndarray, list[int]]:
        out = self.processor(images=[image], return_tensors="np", do_pan_and_scan=False)
        return out["pixel_values"][0], [self.vision.image_token_id] * self.vision.tokens_per_image

    @classmethod
    def for_model(cls, model_dir: Path, vision: VisionConfig, tokenizer: Any) -> Gemma3Layout:
        """With the directory's preprocessor config, else Gemma 3's defaults at the tower's image
        size (the PIL backend: no torchvision needed)."""
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        if (Path(model_dir) / "preprocessor_config.json").is_file():
            return cls(vision, Gemma3ImageProcessorPil.from_pretrained(str(model_dir)), tokenizer)
        side = vision.image_size
        return cls(vision, Gemma3ImageProcessorPil(size={"height": side, "width": side}), tokenizer)


class Idefics3Layout:
    place_tokens = 1
    bidirectional = False  # Idefics3's text model is causal over image tokens too

    def __init__(self, vision: VisionConfig, processor: Any) -> None:
        self.processor = processor
        self.placeholder = processor.image_token
        if processor.image_token_id != vision.image_token_id:
            raise ValueError(f"the tokenizer's {self.placeholder!r} is id {processor.image_token_id}; "
                             f"config.json's image_token_id is {vision.image_token_id}")

    def expand_text(self, text: str) -> str:
        return text  # each "<image>" is expanded by ids, once its tiles are known

    def process(self, image: Image.Image) -> tuple[np.ndarray, list[int]]:
        out = self.processor(text=self.placeholder, images=[image], return_tensors="np",
                             add_special_tokens=False)
        # One image alone: its tiles all have the tile size, so no pixel is padding (the tower
        # runs unmasked, as HF's does on this image's unpadded tiles).
        assert out["pixel_attention_mask"].all(), "an image's tiles differ in size"
        return out["pixel_values"][0], out["input_ids"][0].tolist()

    @classmethod
    def for_model(cls, model_dir: Path, vision: VisionConfig, tokenizer: Any) -> Idefics3Layout:
        """HF's Idefics3Processor with the directory's preprocessor config (the PIL backend), else
        tiles of the tower's image size; its own copy of the tokenizer (the processor adds its
        special tokens to the one it is given)."""
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil,
        )

        if (Path(model_dir) / "preprocessor_config.json").is_file():
            images = Idefics3ImageProcessorPil.from_pretrained(str(model_dir))
        else:
            side = vision.image_size
            images = Idefics3ImageProcessorPil(max_image_size={"longest_edge": side},
                                               size={"longest_edge": 4 * side})
        proc = Idefics3Processor(image_processor=images, tokenizer=copy.deepcopy(tokenizer),
                                 image_seq_len=vision.tokens_per_image)
        return cls(vision, proc)


LAYOUTS: dict[str, Any] = {"gemma3": Gemma3Layout, "idefics3": Idefics3Layout}


def layout_for(model_dir: Path, vision: VisionConfig, tokenizer: Any) -> ImageLayout:
    return LAYOUTS[vision.family].for_model(model_dir, vision, tokenizer)

"""The front process's image work for a request: decode each image (lockstep.multimodal.images),
preprocess it with the model's own HF image processor, hash the pixels, put them in shared memory,
and mark its tokens in the prompt with hash-derived ids. Prompts place images as HF's processor
does: each `<start_of_image>` in the text becomes "\\n\\n<start_of_image>" + tokens_per_image image
tokens + "<end_of_image>\\n\\n" (`expand_text`), and token prompts already hold those runs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.configs.vision_config import VisionConfig
from lockstep.multimodal.images import ImageError, ImageLimits, load_image
from lockstep.multimodal.refs import ImageRef, is_pad_id, pad_id
from lockstep.multimodal.shm import write_pixels


@dataclass
class PreparedImages:
    input_ids: list[int]  # image tokens replaced by their images' pad ids
    images: list[ImageRef]
    segments: list[shared_memory.SharedMemory]  # the caller owns them (ImageSegments)


def image_processor(model_dir: Path, vision: VisionConfig) -> Any:
    """The model's HF image processor (PIL backend: no torchvision needed); its preprocessor
    config where the directory has one, else Gemma 3's defaults at the tower's image size."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    if (Path(model_dir) / "preprocessor_config.json").is_file():
        return Gemma3ImageProcessorPil.from_pretrained(str(model_dir))
    side = vision.image_size
    return Gemma3ImageProcessorPil(size={"height": side, "width": side})


class ImageInputs:
    """One model's image handling in the front process."""

    def __init__(self, vision: VisionConfig, processor: Any, tokenizer: Any, limits: ImageLimits) -> None:
        self.vision = vision
        self.processor = processor
        self.limits = limits
        self.boi = tokenizer.convert_ids_to_tokens(vision.boi_token_id)
        self.image_token = tokenizer.convert_ids_to_tokens(vision.image_token_id)
        self.eoi = tokenizer.convert_ids_to_tokens(vision.eoi_token_id)

    @property
    def placeholder(self) -> str:
        """What a prompt's text writes where an image goes."""
        return self.boi

    def expand_text(self, text: str) -> str:
        full = f"\n\n{self.boi}{self.image_token * self.vision.tokens_per_image}{self.eoi}\n\n"
        return text.replace(self.boi, full)

    def pixels(self, source: str, what: str) -> np.ndarray:
        """[3, H, W] float32 pixels of one client image, as the HF processor makes them."""
        img = load_image(source, self.limits, what)
        out = self.processor(images=[img], return_tensors="np", do_pan_and_scan=False)
        return np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)

    def prepare(self, input_ids: list[int], sources: list[str]) -> PreparedImages:
        """Decode, preprocess, hash and share each image; ImageError names what is wrong."""
        if len(sources) > self.limits.max_images:
            raise ImageError(f"image_data: {len(sources)} images, more than {self.limits.max_images} "
                             "per request (--max-images-per-request)")
        if (bad := next((t for t in input_ids if is_pad_id(t)), None)) is not None:
            raise ImageError(f"input_ids: token id {bad} is outside the vocabulary")
        runs = self._runs(input_ids)
        if len(runs) != len(sources):
            raise ImageError(f"the prompt has {len(runs)} image places ({self.placeholder!r} in its "
                             f"text) for {len(sources)} images")
        ids, refs, segments = list(input_ids), [], []
        try:
            for i, (source, start) in enumerate(zip(sources, runs)):
                px = self.pixels(source, f"image {i}")
                digest = hashlib.sha256(px.tobytes()).hexdigest()
                seg = write_pixels(px)
                segments.append(seg)
                n = self.vision.tokens_per_image
                refs.append(ImageRef(digest, seg.name, tuple(px.shape), start, n))
                ids[start:start + n] = [pad_id(digest)] * n
        except BaseException:
            for seg in segments:
                seg.close()
                seg.unlink()
            raise
        return PreparedImages(ids, refs, segments)

    def _runs(self, ids: list[int]) -> list[int]:
        """Start of each run of image tokens; each must be tokens_per_image long."""
        tok, n = self.vision.image_token_id, self.vision.tokens_per_image
        starts, i = [], 0
        while i < len(ids):
            if ids[i] != tok:
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] == tok:
                j += 1
            if j - i != n:
                raise ImageError(f"the prompt has a run of {j - i} image tokens at position {i}; "
                                 f"each image takes exactly {n}")
            starts.append(i)
            i = j
        return starts


def image_inputs_for(model_dir: Path, hf_config: dict[str, Any], tokenizer: Any,
                     limits: ImageLimits) -> ImageInputs | None:
    """The front's image handling for a model directory; None for a model that reads no images."""
    vision = VisionConfig.from_hf(hf_config)
    if vision is None:
        return None
    return ImageInputs(vision, image_processor(model_dir, vision), tokenizer, limits)

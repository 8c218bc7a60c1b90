"""The front process's image work for a request: decode each image (lockstep.multimodal.images),
preprocess it with the model's own HF processor (the family's layout: lockstep.multimodal.layouts),
hash the pixels, put them in shared memory, and put its tokens in the prompt with hash-derived ids.
The prompt's text is expanded as HF's processor does (`expand_text`) before tokenizing; each image's
place in the tokenized prompt (a run of `place_tokens` image tokens) then becomes the image's own
tokens, its image tokens carrying the image's pad id, one ImageRef per run of them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.configs.vision_config import VisionConfig
from lockstep.multimodal.images import ImageError, ImageLimits, load_image
from lockstep.multimodal.layouts import ImageLayout, layout_for
from lockstep.multimodal.refs import ImageRef, is_pad_id, pad_id
from lockstep.multimodal.shm import write_pixels


@dataclass
class PreparedImages:
    input_ids: list[int]  # image places replaced by the images' tokens, with their pad ids
    images: list[ImageRef]
    segments: list[shared_memory.SharedMemory]  # the caller owns them (ImageSegments)


class ImageInputs:
    """One model's image handling in the front process."""

    def __init__(self, vision: VisionConfig, layout: ImageLayout, limits: ImageLimits) -> None:
        self.vision = vision
        self.layout = layout
        self.limits = limits

    @property
    def placeholder(self) -> str:
        """What a prompt's text writes where an image goes."""
        return self.layout.placeholder

    def expand_text(self, text: str) -> str:
        return self.layout.expand_text(text)

    def pixels(self, source: str, what: str) -> np.ndarray:
        """The float32 pixels of one client image, as the HF processor makes them."""
        return self._process(source, what)[0]

    def _process(self, source: str, what: str) -> tuple[np.ndarray, list[int]]:
        px, tokens = self.layout.process(load_image(source, self.limits, what))
        return np.ascontiguousarray(px, dtype=np.float32), tokens

    def prepare(self, input_ids: list[int], sources: list[str]) -> PreparedImages:
        """Decode, preprocess, hash and share each image; ImageError names what is wrong."""
        if len(sources) > self.limits.max_images:
            raise ImageError(f"image_data: {len(sources)} images, more than {self.limits.max_images} "
                             "per request (--max-images-per-request)")
        if (bad := next((t for t in input_ids if is_pad_id(t)), None)) is not None:
            raise ImageError(f"input_ids: token id {bad} is outside the vocabulary")
        places = self._places(input_ids)
        if len(places) != len(sources):
            raise ImageError(f"the prompt has {len(places)} image places ({self.placeholder!r} in its "
                             f"text) for {len(sources)} images")
        ids: list[int] = []
        refs: list[ImageRef] = []
        segments: list[shared_memory.SharedMemory] = []
        cursor = 0
        try:
            for i, (source, start) in enumerate(zip(sources, places)):
                px, tokens = self._process(source, f"image {i}")
                digest = hashlib.sha256(px.tobytes()).hexdigest()
                seg = write_pixels(px)
                segments.append(seg)
                ids.extend(input_ids[cursor:start])
                refs.extend(self._refs(digest, seg.name, tuple(px.shape), tokens, len(ids)))
                pad = pad_id(digest)
                ids.extend(pad if t == self.vision.image_token_id else t for t in tokens)
                cursor = start + self.layout.place_tokens
        except BaseException:
            for seg in segments:
                seg.close()
                seg.unlink()
            raise
        ids.extend(input_ids[cursor:])
        return PreparedImages(ids, refs, segments)

    def _refs(self, digest: str, shm_name: str, shape: tuple[int, ...], tokens: list[int],
              base: int) -> list[ImageRef]:
        """One ref per run of image tokens in an image's `tokens` (placed at prompt position
        `base`), taking the image's feature rows in order."""
        refs, feature = [], 0
        for i, j in _runs(tokens, self.vision.image_token_id):
            refs.append(ImageRef(digest, shm_name, shape, base + i, j - i, feature,
                                 self.layout.bidirectional))
            feature += j - i
        return refs

    def _places(self, ids: list[int]) -> list[int]:
        """Start of each run of image tokens; each must be place_tokens long."""
        n = self.layout.place_tokens
        runs = _runs(ids, self.vision.image_token_id)
        for i, j in runs:
            if j - i != n:
                raise ImageError(f"the prompt has a run of {j - i} image tokens at position {i}; "
                                 f"each image's place is exactly {n}")
        return [i for i, _ in runs]


def _runs(tokens: list[int], tok: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `tok` in `tokens`, in order."""
    runs, i = [], 0
    while i < len(tokens):
        if tokens[i] != tok:
            i += 1
            continue
        j = i
        while j < len(tokens) and tokens[j] == tok:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def image_inputs_for(model_dir: Path, hf_config: dict[str, Any], tokenizer: Any,
                     limits: ImageLimits) -> ImageInputs | None:
    """The front's image handling for a model directory; None for a model that reads no images."""
    vision = VisionConfig.from_hf(hf_config)
    if vision is None:
        return None
    return ImageInputs(vision, layout_for(model_dir, vision, tokenizer), limits)

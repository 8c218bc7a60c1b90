"""What a request carries of an image through the broadcast: its content hash, where its pixels
are (a shared-memory segment's name, shape and dtype) and where its tokens sit in the prompt.
A few hundred bytes, whatever the image's size. An image whose tokens are interrupted by text
(Idefics3's tiles, each behind its own `<row_r_col_c>` tokens) is one ref per run of image
tokens, all with the image's digest and segment: each names the features it takes."""

from __future__ import annotations

from dataclasses import dataclass

# Image tokens enter the prompt (and so the prefix tree) as this base plus hash bits: above any
# vocabulary, so an image's tokens never equal a text token's, and two different images'
# tokens differ (with the odds of 62 bits of sha256 colliding).
PAD_ID_BASE = 1 << 62


def pad_id(digest: str) -> int:
    """The token id an image's tokens carry in the prompt, from its sha256 hex digest."""
    return PAD_ID_BASE + (int(digest[:16], 16) >> 2)


def is_pad_id(token: int) -> bool:
    return token >= PAD_ID_BASE


@dataclass(frozen=True)
class ImageRef:
    digest: str  # sha256 hex of the preprocessed pixel bytes: the encoder cache's key
    shm_name: str  # the shared-memory segment holding the pixels (lockstep.multimodal.shm)
    shape: tuple[int, ...]  # of the float32 pixels: [channels, height, width], or [tiles, c, h, w]
    offset: int  # prompt position of this run's first image token
    num_tokens: int
    feature_offset: int = 0  # which of the image's feature rows the run's first token takes
    # The image's tokens see each other (Gemma 3 was trained with that mask); False: causal like
    # text (Idefics3).
    bidirectional: bool = True

    @property
    def pad_id(self) -> int:
        return pad_id(self.digest)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

"""What a request carries of an image through the broadcast: its content hash, where its pixels
are (a shared-memory segment's name, shape and dtype) and where its tokens sit in the prompt.
A few hundred bytes, whatever the image's size."""

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
    shape: tuple[int, ...]  # of the float32 pixel tensor, [channels, height, width]
    offset: int  # prompt position of the image's first token
    num_tokens: int

    @property
    def pad_id(self) -> int:
        return pad_id(self.digest)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

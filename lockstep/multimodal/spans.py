"""Where a request's images fall in a step's tokens: which image tokens a pass computes (and at
which rows of the batch), how far each image row attends (a bidirectional image's tokens see each
other, as Gemma 3 was trained: HF's block mask; Idefics3's attend causally, like text), and where
a prefill chunk may end (never inside a run of image tokens, whose rows may need the whole run's
keys in the same pass)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lockstep.multimodal.refs import ImageRef, pad_id


@dataclass(frozen=True)
class ImageRows:
    """Feature rows [first, first + count) of `image`, computed at batch rows [row, row + count)."""

    image: ImageRef
    first: int
    count: int
    row: int


def rows_in_pass(images: Sequence[ImageRef], start: int, end: int, row0: int
                 ) -> tuple[list[ImageRows], list[tuple[int, int, int]]]:
    """A request computing positions [start, end) at batch rows from row0: its image rows, and
    (first row, row count, keys seen) runs for the attention: every row of a bidirectional image
    sees the keys up to the image's end."""
    rows, floors = [], []
    for im in images:
        lo, hi = max(im.offset, start), min(im.end, end)
        if lo < hi:
            rows.append(ImageRows(im, im.feature_offset + lo - im.offset, hi - lo, row0 + lo - start))
            if im.bidirectional:
                floors.append((row0 + lo - start, hi - lo, im.end))
    return rows, floors


def chunk_take(images: Sequence[ImageRef], start: int, take: int, remaining: int) -> int:
    """`take` tokens from `start`, moved so that a chunk never ends inside an image: back to the
    image's start, or past its end where the chunk begins inside it (or at its start)."""
    end = start + take
    if take >= remaining:
        return take
    for im in images:
        if im.offset < end < im.end:
            return im.offset - start if im.offset > start else min(im.end - start, remaining)
    return take


def outside_vocab(ids: Sequence[int], images: Sequence[ImageRef], vocab_size: int) -> int | None:
    """The first id outside [0, vocab_size) that is not one of `images`' own tokens in its own
    span, or None. A prompt can never carry an image's id elsewhere: its KV, computed without the
    image, would enter the prefix tree under that image's ids."""
    spans = {i: pad_id(im.digest) for im in images for i in range(im.offset, im.end)}
    for i, t in enumerate(ids):
        if (t < 0 or t >= vocab_size) and spans.get(i) != t:
            return t
    for i, t in spans.items():
        if i >= len(ids) or ids[i] != t:
            return ids[i] if i < len(ids) else -1
    return None

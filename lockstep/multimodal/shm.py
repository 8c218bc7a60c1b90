"""Pixels from the front process to the scheduler ranks through POSIX shared memory: the front
writes each preprocessed image once into a segment of a unique name and owns it (it unlinks it
when the request ends: `ImageSegments`); a rank copies the pixels out by name when its vision
tower needs them. The per-step broadcast carries only the name (lockstep.multimodal.refs)."""

from __future__ import annotations

import _posixshmem
import mmap
import os
import uuid
from multiprocessing import shared_memory

import numpy as np
import torch

SEGMENT_PREFIX = "lockstep-img-"


def write_pixels(pixels: np.ndarray) -> shared_memory.SharedMemory:
    """A new segment holding `pixels` (float32, C order); the caller owns it (close + unlink)."""
    data = np.ascontiguousarray(pixels, dtype=np.float32)
    seg = shared_memory.SharedMemory(name=f"{SEGMENT_PREFIX}{uuid.uuid4().hex}", create=True,
                                     size=max(1, data.nbytes))
    np.ndarray(data.shape, np.float32, buffer=seg.buf)[...] = data
    return seg


def read_pixels(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A copy of the float32 pixels in segment `name`. Opened without multiprocessing's
    SharedMemory, whose resource tracker would count this reader as an owner (and unlink the
    front's segment when this process exits)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    try:
        count = int(np.prod(shape))
        with mmap.mmap(fd, count * 4, prot=mmap.PROT_READ) as mem:
            return torch.from_numpy(np.frombuffer(mem, np.float32, count).reshape(shape).copy())
    finally:
        os.close(fd)


class ImageSegments:
    """The front's segments by request id, unlinked when the request has ended at the scheduler
    (its last output arrived, so no rank reads them again) or was never sent."""

    def __init__(self) -> None:
        self.held: dict[str, list[shared_memory.SharedMemory]] = {}

    def hold(self, rid: str, segments: list[shared_memory.SharedMemory]) -> None:
        if segments:
            self.held.setdefault(rid, []).extend(segments)

    def release(self, rid: str) -> None:
        for seg in self.held.pop(rid, ()):
            seg.close()
            try:
                seg.unlink()
            except FileNotFoundError:
                pass

    def release_all(self) -> None:
        for rid in list(self.held):
            self.release(rid)

"""The cache root (converted models, compiled kernels, test models) and its cross-process lock."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs
from filelock import FileLock

CACHE_ENV = "LOCKSTEP_CACHE_DIR"


def cache_dir(*parts: str) -> Path:
    """$LOCKSTEP_CACHE_DIR, else the platform's user cache folder (~/.cache/lockstep on Linux,
    $XDG_CACHE_HOME/lockstep where that is set), joined with `parts`."""
    root = os.environ.get(CACHE_ENV) or platformdirs.user_cache_dir("lockstep", appauthor=False)
    return Path(root).joinpath(*parts)


def cache_lock(path: Path) -> FileLock:
    """An exclusive lock on `path` across processes, so peer schedulers starting together build
    a cache entry once; the OS drops it when its holder dies, so a crash never wedges a start."""
    return FileLock(path)

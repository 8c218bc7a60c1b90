"""Process plumbing: free ports, parent-death signals, process titles, tree kills by PID, and
what every server child process does around its set-up and its main loop."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import socket
import sys
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection

import psutil
import setproctitle

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Linux: the kernel sends us SIGKILL when the parent dies, so no child ever lingers."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        logger.warning("PR_SET_PDEATHSIG unavailable; children may outlive a killed parent")


# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_FREED_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """glibc gives an allocation of 32 MiB or more (its mmap threshold's cap) a fresh mapping and unmaps it
    on free, so every batch-32 decode step's 32 MiB of vocabulary logits came in as 8,192 new zeroed pages,
    each a page fault and a zeroing the reused memory does not pay (docs/benchmarks.md, "Zen 4, night"). With mmap off for malloc
    and up to KEEP_FREED_BYTES of freed heap kept, the next step reuses the same memory. For a process that
    runs a model on the CPU; False where the C library has no mallopt (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES))
    except (OSError, AttributeError):
        return False


def kill_tree(pid: int) -> None:
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for p in [*proc.children(recursive=True), proc]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def configure_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[%(asctime)s {prefix}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S", force=True,
    )


def start_child(title: str, log_level: str, log_prefix: str) -> None:
    """A server child's first steps: die with the parent, show `lockstep::title`, log under
    `log_prefix`."""
    die_with_parent()
    setproctitle.setproctitle(f"lockstep::{title}")
    configure_logging(log_level, log_prefix)


@contextlib.contextmanager
def exit_on_error(what: str, pipe: Connection | None = None) -> Iterator[None]:
    """Around a child's set-up (with the launcher's `pipe`, which is told why) or its main loop:
    an exception is logged with its traceback and the process exits non-zero, so the launcher's
    child watch brings the whole server down. SGLang sends SIGQUIT to the parent instead, which
    would kill a user's process hosting an Engine."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any failure is reported, never swallowed
        logger.error("%s %s:\n%s", what, "failed to start" if pipe else "crashed",
                     traceback.format_exc())
        if pipe is not None:
            pipe.send({"status": "error", "message": f"{what}: {type(e).__name__}: {e}"})
        sys.exit(1)

"""Process plumbing: free ports, parent-death signals, process titles, tree kills by PID."""

from __future__ import annotations

import ctypes
import logging
import signal
import socket

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


def set_title(title: str) -> None:
    setproctitle.setproctitle(title)


def kill_tree(pid: int, include_self: bool = True, sig: int = signal.SIGKILL) -> None:
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = proc.children(recursive=True) + ([proc] if include_self else [])
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def configure_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[%(asctime)s {prefix}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S", force=True,
    )

"""Faults injected into a live server's processes by tests, with no hook in the production code.

`perturb_env(dir, process)` returns environment variables that make every Python process of
the server run this module's `install()` at start (through a `sitecustomize` in `dir`); in the
process named `process` (e.g. "scheduler-DP0-TP1-PP0") the scheduler then reverses the order of
every batch of two or more requests, so that rank's decisions differ from the others': what the
lockstep check must catch. With process "detokenizer", the detokenizer instead hangs in the
first message that carries a request whose rid starts with "stall": what its watchdog must
catch."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

PERTURB_ENV = "LOCKSTEP_FAULT_PERTURB_PROCESS"


def perturb_env(directory: Path, process: str) -> dict[str, str]:
    (directory / "sitecustomize.py").write_text(
        "from lockstep.testing.faults import install\n\ninstall()\n")
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, PERTURB_ENV: process}


def install() -> None:
    target = os.environ.get(PERTURB_ENV)
    if not target:
        return
    if target == "detokenizer":
        _stall_detokenizer()
        return
    from lockstep.managers.scheduler import Scheduler

    form_batch = Scheduler.form_batch

    def perturbed(self: Scheduler):  # type: ignore[no-untyped-def]
        batch = form_batch(self)
        # A spawned child learns its name after start-up, so it is checked here.
        if batch is not None and len(batch.reqs) > 1 and mp.current_process().name == target:
            batch.reqs.reverse()
            batch.samples.reverse()
        return batch

    Scheduler.form_batch = perturbed  # type: ignore[method-assign]


def _stall_detokenizer() -> None:
    import time

    from lockstep.detokenizer.detokenizer_manager import DetokenizerManager

    handle = DetokenizerManager.handle

    def stalling(self: DetokenizerManager, batch):  # type: ignore[no-untyped-def]
        if any(o.rid.startswith("stall") for o in batch.outputs):
            while True:  # a message that never finishes, as the backtracking stop_regex did
                time.sleep(1)
        return handle(self, batch)

    DetokenizerManager.handle = stalling  # type: ignore[method-assign]

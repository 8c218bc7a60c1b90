"""Faults injected into a live server's processes by tests, with no hook in the production code.

`perturb_env(dir, process)` returns environment variables that make every Python process of
the server run this module's `install()` at start (through a `sitecustomize` in `dir`); in the
process named `process` (e.g. "scheduler-DP0-TP1-PP0") the scheduler then reverses the order of
every batch of two or more requests, so that rank's decisions differ from the others': what the
lockstep check must catch. With process "detokenizer", the detokenizer instead hangs in the
first message that carries a request whose rid starts with "stall": what its watchdog must
catch.

A fault replaces a method by name, so each installation writes `installed_marker(...)` to
stderr (the server's log) and a test asserts it: a renamed method then fails the test at once,
naming the method, instead of leaving a fault that never fires and a test that times out."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PERTURB_ENV = "LOCKSTEP_FAULT_PERTURB_PROCESS"
SCHEDULER_METHOD = "lockstep.managers.scheduler.Scheduler.form_batch"
DETOKENIZER_METHOD = "lockstep.detokenizer.detokenizer_manager.DetokenizerManager.handle"


def installed_marker(method: str) -> str:
    """The line a process writes once it has replaced `method` (module.Class.name)."""
    return f"[lockstep fault] installed: {method}"


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
        _replace(DETOKENIZER_METHOD, _stalling)
    else:
        _replace(SCHEDULER_METHOD, lambda form_batch: _perturbing(form_batch, target))


def _replace(method: str, wrap: Callable[[Any], Any]) -> None:
    """Replace `method` (module.Class.name) by `wrap(original)`, and say so on stderr."""
    import importlib

    module_name, class_name, name = method.rsplit(".", 2)
    cls = getattr(importlib.import_module(module_name), class_name)
    original = cls.__dict__.get(name)
    if original is None:  # site.py prints this one line and the process goes on, fault-free
        raise AttributeError(f"lockstep.testing.faults: {method} does not exist; the fault "
                             "replaces it by name, so update the fault to the method's new name")
    setattr(cls, name, wrap(original))
    sys.stderr.write(f"{installed_marker(method)} (pid {os.getpid()})\n")
    sys.stderr.flush()


def _perturbing(form_batch: Callable[[Any], Any], target: str) -> Callable[[Any], Any]:
    def perturbed(self: Any) -> Any:
        batch = form_batch(self)
        # A spawned child learns its name after start-up, so it is checked here.
        if batch is not None and len(batch.reqs) > 1 and mp.current_process().name == target:
            batch.reqs.reverse()
            batch.samples.reverse()
        return batch
    return perturbed


def _stalling(handle: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    import time

    def stalling(self: Any, batch: Any) -> Any:
        if any(o.rid.startswith("stall") for o in batch.outputs):
            while True:  # a message that never finishes, as the backtracking stop_regex did
                time.sleep(1)
        return handle(self, batch)
    return stalling

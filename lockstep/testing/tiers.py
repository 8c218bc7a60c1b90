"""The test tiers: which markers a test gets follows from what it needs, not from a list of names.

- `server`: the test starts lockstep processes (a live server, an offline Engine, ranks spawned as
  processes). A fixture that starts them declares it with `@marks("server")`; a test that starts
  them in its body carries `@pytest.mark.server` (or its module a `pytestmark`). A test that
  starts processes without the marker fails (`guard_process_starts`), so `make test-fast` cannot
  quietly grow a server start.
- `real_model`: the test loads a real packaged model (Gemma 3 270M, named where exact outputs
  matter, or the default SmolLM2-135M-Instruct), through a fixture declared with
  `@marks("real_model")` or the marker itself.
- `soak`: long reliability runs, only under `make soak`.

`make test-fast` runs `-m "not server and not real_model and not soak"`; `make test` runs everything
but soak.
"""

from __future__ import annotations

import multiprocessing.context
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from lockstep.testing.live_server import LiveServer

F = TypeVar("F", bound=Callable[..., Any])
MARKERS = {
    "server": "starts lockstep processes: a live server, an Engine, ranks spawned as processes",
    "real_model": "loads a real packaged model: Gemma 3 270M or the default, SmolLM2-135M-Instruct "
                  "(slow to load)",
    "soak": "long-form reliability runs, only under `make soak`",
}
_ATTR = "__lockstep_test_marks__"
_RUNNING = pytest.StashKey["pytest.Item | None"]()  # the test running now (set-up included)


def marks(*names: str) -> Callable[[F], F]:
    """Put under `@pytest.fixture`: every test that uses the fixture, directly or through another
    fixture, gets these markers."""
    unknown = set(names) - set(MARKERS)
    if unknown:
        raise ValueError(f"unknown test marker(s) {sorted(unknown)}; known: {sorted(MARKERS)}")

    def wrap(fn: F) -> F:
        setattr(fn, _ATTR, names)
        return fn
    return wrap


# The hooks below are pytest's: tests/conftest.py imports them, which registers them.


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    guard_process_starts(config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    config = item.config
    config.stash[_RUNNING] = item
    try:
        return (yield)
    finally:
        config.stash[_RUNNING] = None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for defs in info.name2fixturedefs.values():
            for fixturedef in defs:
                for name in getattr(fixturedef.func, _ATTR, ()):
                    item.add_marker(name)


def _guarded(config: pytest.Config, what: str, start: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        item = config.stash.get(_RUNNING, None)
        if item is not None and item.get_closest_marker("server") is None:
            raise RuntimeError(
                f"{item.nodeid} starts {what} but is not marked `server`: mark the test, or the "
                "fixture that starts them with lockstep.testing.tiers.marks, so that "
                "`make test-fast` leaves it out")
        return start(*args, **kwargs)
    return guarded


def guard_process_starts(config: pytest.Config) -> None:
    """While a test not marked `server` runs (its fixtures' set-up included), starting lockstep
    processes raises: every launch path spawns with multiprocessing's spawn context, and tests
    run `lockstep.launch_server` through LiveServer. Patched for this pytest process only."""
    spawn = multiprocessing.context.SpawnProcess
    spawn.start = _guarded(config, "spawned processes", spawn.start)  # type: ignore[method-assign]
    LiveServer.__init__ = _guarded(config, "a live server", LiveServer.__init__)  # type: ignore[method-assign]

"""Fixtures the test modules share, thin over lockstep.testing (its docstring says what lives
where), and the tiers: markers follow from the fixtures a test uses (lockstep.testing.tiers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockstep.testing import kernels
from lockstep.testing.live_server import API_KEY, LiveServer, real_model_server, running_engine
from lockstep.testing.tiers import (  # noqa: F401 - the tiers' pytest hooks, registered here
    marks,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_protocol,
)
from lockstep.testing.tiny_models import TINY_ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs() -> dict[str, Path]:
    """Every tiny architecture's HF directory, built once and cached (lockstep.testing.tiny_models)."""
    return {arch: make_tiny_model(arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny llama's HF directory: the model most tests serve."""
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
@marks("server")
def llama_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server of the tiny llama behind --api-key API_KEY, shared by the session; at the end
    SIGTERM must stop it with status 0 and no child left."""
    srv = LiveServer("--model-path", str(model_dir), "--max-total-tokens", "8192",
                     "--api-key", API_KEY, log_dir=tmp_path_factory.mktemp("tiny-server"),
                     startup_timeout=180)
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def passive_openmp_threads() -> Iterator[None]:
    """The servers a module starts get OpenMP threads that sleep instead of spinning while they
    wait. On a shared, oversubscribed machine (CI, a suite beside other test runs) spinning made a
    tiny-model decode step about 10x slower; the reliability suites measure survival, not speed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_WAIT_POLICY", "PASSIVE")
        yield


@pytest.fixture(scope="session")
@marks("server", "real_model")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server of Gemma 3 270M (named: the tests on it know its outputs) for the whole session
    (it is slow to load)."""
    with real_model_server(tmp_path_factory.mktemp("real-server")) as server:
        yield server  # type: ignore[misc]


@pytest.fixture(scope="session")
@marks("server", "real_model")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server started as a new user starts one: no --model-path (the default model), no key."""
    srv = LiveServer("--max-total-tokens", "8192", log_dir=tmp_path_factory.mktemp("default-server"))
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="session")
@marks("real_model")
def gemma_gguf() -> Any:
    """Gemma 3 270M's GGUF (a gguf.GGUFReader): its real blocks, for the kernel tests."""
    return kernels.gemma_gguf()


@pytest.fixture(scope="module")
@marks("server")
def engine(model_dir: Path) -> Iterator[Any]:
    """An offline lockstep.Engine on the tiny llama; no process of it may outlive the module."""
    with running_engine(model_dir, max_total_tokens=4096) as eng:
        yield eng

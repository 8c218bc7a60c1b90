"""The test tiers (lockstep.testing.tiers), in a pytest run of their own: a fixture's markers reach
the tests that use it, and a test that starts lockstep processes without the `server` marker fails
instead of slowing `make test-fast`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lockstep

REPO = Path(lockstep.__file__).resolve().parents[1]

CONFTEST = """
from lockstep.testing.tiers import pytest_collection_modifyitems, pytest_configure, pytest_runtest_protocol
"""
TESTS = '''
import multiprocessing

import pytest

from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks


def spawn_and_join():
    proc = multiprocessing.get_context("spawn").Process(target=print)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


@pytest.fixture(scope="module")
@marks("server")
def started():
    spawn_and_join()


@pytest.fixture
def through_another(started):
    return started


def test_through_a_marked_fixture(through_another):
    pass


def test_unmarked_live_server(tmp_path):
    LiveServer("--model-path", "unused", log_dir=tmp_path)


def test_unmarked_spawn():
    multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.server
def test_marked_spawn():
    spawn_and_join()
'''


def run(tmp_path: Path, *args: str) -> str:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_inner.py").write_text(TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                           "--strict-markers", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    return done.stdout + done.stderr


def test_a_marked_fixture_marks_its_tests_and_an_unmarked_process_start_fails(tmp_path):
    out = run(tmp_path)
    assert "2 failed, 2 passed" in out, out
    # the fixture's spawn ran: its marker reached the test through the other fixture (the guard
    # reads the same markers `-m "not server"` selects by)
    assert "PASSED test_inner.py::test_through_a_marked_fixture" in out, out
    for name, what in (("test_unmarked_live_server", "a live server"),
                       ("test_unmarked_spawn", "spawned processes")):
        assert f"test_inner.py::{name} starts {what} but is not marked `server`" in out, out

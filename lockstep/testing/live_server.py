"""Live lockstep processes for tests: a `python -m lockstep.launch_server` process (a free port,
waited for on /health, stopped by its PID: SIGTERM, then SIGKILL, never by name), the real-model
server one test session shares (Gemma 3 270M, named), an offline `Engine` that must leave no process behind, and SSE
parsing of a streamed reply."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import requests

from lockstep.utils.process import die_with_parent, free_port


class LiveServer:
    """`python -m lockstep.launch_server ARGS --port <free>`, waited for on /health; stopped by
    its PID (SIGTERM, then SIGKILL), never by name."""

    def __init__(self, *args: str, log_dir: Path, startup_timeout: float = 600.0,
                 wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "lockstep.launch_server", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent)  # never outlive the test run
        self.child_pids: list[int] = []
        # What /health answered while the server started, in order, without repeats (None: the
        # connection was refused): [None, 503, 200] when it says "starting" before "ready".
        self.startup_health: list[int | None] = []
        self.startup_timeout = startup_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Start several servers at once with wait=False, then wait for each. Start them from
        the main thread: the parent-death signal fires when the *thread* that spawned them ends."""
        try:
            self._wait_healthy(self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        with contextlib.suppress(psutil.NoSuchProcess):
            self.child_pids = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def _wait_healthy(self, timeout: float) -> None:
        seen = self.__dict__.setdefault("startup_health", [])  # subclasses may skip __init__
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status: int | None = requests.get(self.url + "/health", timeout=2).status_code
            except requests.RequestException:
                status = None
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        if not self._log.closed:  # still readable after stop()
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 40.0) -> None:
        """SIGTERM (a graceful drain of whatever still runs), then SIGKILL after `timeout` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in self.child_pids:  # the scheduler and detokenizer die with the server
            with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
                psutil.Process(pid).wait(timeout=10)
        self._log.close()

    def stop_cleanly(self) -> None:
        """SIGTERM must end the server with status 0 and take every child process with it."""
        children = list(self.child_pids)
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        self.stop()
        assert code == 0, self.log_tail()
        assert not alive_pids(children), f"children outlived the server: {alive_pids(children)}"


# The session's tiny-model server (tests/conftest.py's `llama_server`) sits behind this key, so that the
# tests of --api-key and the tests of everything else share one server start.
API_KEY = "sk-test-lockstep"


# The real model the tests that compare exact outputs run on, by its packaged name: named, never
# the default, so that changing the default changes none of them.
GEMMA = "gemma-3-270m"
# Gemma's server: started once per test session, since loading the model takes long; the modules
# that need it share it (tests/conftest.py's `real_server`).
REAL_MODEL_ARGS = ("--model-path", GEMMA, "--max-total-tokens", "16384")
# A server someone already started (http://host:port): handy when iterating on the real-model
# tests, which otherwise start their own.
EXTERNAL_REAL_SERVER_ENV = "LOCKSTEP_TEST_REAL_SERVER_URL"


class ExternalServer:
    """A server at `url` that this test run did not start and does not stop."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.port = int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return True

    def log_text(self) -> str:
        return ""


@contextlib.contextmanager
def real_model_server(log_dir: Path) -> Iterator[LiveServer | ExternalServer]:
    external = os.environ.get(EXTERNAL_REAL_SERVER_ENV)
    if external:
        yield ExternalServer(external)
        return
    server = LiveServer(*REAL_MODEL_ARGS, log_dir=log_dir)
    try:
        yield server
    finally:
        server.stop()


def alive_pids(pids: list[int]) -> list[int]:
    """The processes of `pids` still running (a zombie counts as gone)."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


@contextlib.contextmanager
def running_engine(model_path: Path | str, **kwargs: Any) -> Iterator[Any]:
    """An offline `lockstep.Engine`; on exit it shuts down (twice: shutdown is idempotent) and
    none of its processes may outlive it."""
    import lockstep

    engine = lockstep.Engine(model_path=str(model_path), **kwargs)
    try:
        yield engine
    finally:
        pids = engine.child_pids
        engine.shutdown()
        engine.shutdown()
    assert not alive_pids(pids), f"engine processes outlived shutdown(): {alive_pids(pids)}"


def sse_events(resp: requests.Response) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, which must end with `data: [DONE]`."""
    events, done = [], False
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        if payload == b"[DONE]":
            done = True
            break
        events.append(json.loads(payload))
    assert done, "stream ended without data: [DONE]"
    return events

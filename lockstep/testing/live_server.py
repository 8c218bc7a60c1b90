"""A live `python -m lockstep.launch_server` process for tests: a free port, waited for on
/health, stopped by its PID (SIGTERM, then SIGKILL), never by name."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

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

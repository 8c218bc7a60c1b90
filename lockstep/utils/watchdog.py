"""The forward-progress watchdog of every scheduler, the detokenizer and the DP controller
(--watchdog-timeout). The event loop calls `step_begins(busy)` once a step's inputs are in hand
and `step_done(busy)` after it (busy: the process holds work). A process busy for `timeout` s
without finishing a step (a hung collective, a stopped peer rank, a forward that never returns)
logs why, dumps every thread's stack and exits with code 1; the launcher's child watch then
brings the server down. No signal goes to the parent: under the offline Engine that is the
user's own Python process. Only this thread reads the clock: no scheduling decision does."""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

logger = logging.getLogger(__name__)


class ForwardProgressWatchdog:
    def __init__(self, timeout: float, name: str,
                 on_fire: Callable[[], None] = functools.partial(os._exit, 1),
                 dump_to: TextIO | None = None) -> None:
        self.timeout = timeout
        self.name = name
        self.on_fire = on_fire
        self.dump_to = dump_to  # default: stderr, which is the server's log
        self.busy = False
        self.since = time.monotonic()
        self.fired = False
        self._thread: threading.Thread | None = None

    def start(self) -> ForwardProgressWatchdog:
        if self.timeout > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name=f"lockstep-watchdog {self.name}")
            self._thread.start()
        return self

    def step_begins(self, busy: bool) -> None:
        if busy and not self.busy:
            self.since = time.monotonic()  # the time first, so the thread never sees a stale one
            self.busy = True

    def step_done(self, busy: bool) -> None:
        self.since = time.monotonic()
        self.busy = busy

    def _watch(self) -> None:
        poll = min(1.0, max(0.05, self.timeout / 10))
        stalled = 0.0
        while stalled <= self.timeout:
            time.sleep(poll)
            stalled = time.monotonic() - self.since if self.busy else 0.0
        self.fired = True
        logger.error("watchdog: %s has held work for %.1f s without finishing a step "
                     "(--watchdog-timeout %g); dumping every thread's stack and bringing the "
                     "server down", self.name, stalled, self.timeout)
        for handler in logging.getLogger().handlers:
            handler.flush()
        out = self.dump_to or sys.stderr
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        self.on_fire()

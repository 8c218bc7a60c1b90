"""Constrained requests waiting for their grammar (SGLang's grammar queue). A grammar compiles on
the grammar backend's own thread while the scheduler goes on stepping; the request is not
admitted until it is ready.

Whether a compile has finished is a wall-clock fact that differs between ranks, so it never
enters a scheduling decision directly: only the input rank reads it (`ready`), and sends the
rids it found ready as a `GrammarsReady` input, broadcast with the step's other inputs; every
rank then `take`s exactly those requests at that point of that step, blocking on its own compile
if it is behind (it started at the same step, so it seldom is)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

from lockstep.constrained.backend import GrammarMatcher
from lockstep.constrained.constraint import ConstraintError
from lockstep.managers.schedule_batch import Req

# How long the input rank waits for a compile when the scheduler has nothing else to do: a
# bound on how late it notices one, not a scheduling input (the readiness it then reads is).
IDLE_WAIT_S = 0.02


class GrammarQueue:
    def __init__(self) -> None:
        self._reqs: list[Req] = []  # in arrival order

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(list(self._reqs))

    def add(self, req: Req, compiling: concurrent.futures.Future[GrammarMatcher]) -> None:
        req.sampling.compiling = compiling
        self._reqs.append(req)

    def remove(self, req: Req) -> None:
        """A request that ends while it waits (aborted): its compile is dropped if not started."""
        if any(r is req for r in self._reqs):  # by identity: requests compare by value
            self._reqs = [r for r in self._reqs if r is not req]
            if req.sampling.compiling is not None:
                req.sampling.compiling.cancel()
                req.sampling.compiling = None

    def ready(self, wait: bool) -> list[str]:
        """The input rank's reading: rids whose grammar has compiled here, in arrival order.
        `wait`: nothing else to do this step, so wait briefly for one instead of spinning."""
        compiling = [(r.rid, r.sampling.compiling) for r in self._reqs if r.sampling.compiling]
        if wait and compiling:
            concurrent.futures.wait([f for _, f in compiling], timeout=IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        return [rid for rid, f in compiling if f.done()]

    def take(self, rids: list[str]) -> list[tuple[Req, str | None]]:
        """Every rank, on the input rank's word: the requests named, out of the queue in arrival
        order with their grammar set, each with None or why its constraint did not compile."""
        named = set(rids)  # membership only: the order is the queue's
        out: list[tuple[Req, str | None]] = []
        taken = [r for r in self._reqs if r.rid in named]
        self._reqs = [r for r in self._reqs if r.rid not in named]
        for req in taken:
            compiling, req.sampling.compiling = req.sampling.compiling, None
            try:
                req.sampling.grammar = compiling.result()  # blocks only on a rank that is behind
                out.append((req, None))
            except ConstraintError as e:
                out.append((req, str(e)))
        return out

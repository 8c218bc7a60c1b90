"""How a scheduler step runs its batch: the plain loop (form, run, process, in that order) or the
overlap loop (SGLang's overlap scheduler: the model runs on a forward thread while the step
processes the previous batch's result). The scheduler forms batches and processes results alike
for both; it asks its loop only for `resolve` (every launched batch's result processed, before
a decision that reads real outputs) and `free_row` (a request row no batch still reads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lockstep.forward_batch import ForwardMode
from lockstep.managers.schedule_batch import ScheduleBatch
from lockstep.managers.scheduler_output_processor import OutputProcessor, SchedulerStats
from lockstep.managers.tp_worker import TpModelWorker
from lockstep.managers.tp_worker_overlap_thread import TpModelWorkerClient


class Scheduler(Protocol):
    """What a loop uses of its scheduler (lockstep.managers.scheduler.Scheduler)."""

    worker: TpModelWorker
    outputs: OutputProcessor
    stats: SchedulerStats
    req_to_token_pool: Any

    def get_next_batch_to_run(self) -> ScheduleBatch | None: ...

    def is_idle(self) -> bool: ...

    def check_integrity(self) -> None: ...


class PlainLoop:
    """Each step runs its batch to the end before the next is formed."""

    in_flight = False  # nothing is ever left running between steps

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    def step(self) -> None:
        sched = self.sched
        batch = sched.get_next_batch_to_run()
        if batch is not None:
            res = sched.worker.forward_batch_generation(batch.worker_batch)
            sched.outputs.process_batch_result(batch, res)
        elif sched.is_idle():
            sched.check_integrity()

    def resolve(self) -> bool:
        """Every result is processed already: False, nothing was in flight."""
        return False

    def free_row(self, row: int) -> None:
        self.sched.req_to_token_pool.free(row)


@dataclass
class InFlight:
    """A batch launched on the forward thread whose result is not processed yet."""

    batch: ScheduleBatch
    seq: int  # launch number
    futures: list[int]  # placeholder of each token it samples, in sampling-row order


class OverlapLoop:
    """Launch this step's batch, then process the previous one's result while it computes.

    The previous result is always awaited at this same point of the step, whatever the thread's
    timing, so every rank makes the same decisions. Some steps need that result before they can
    schedule, and resolve it first (`resolve`), which is the plain loop's order: after a prefill
    or mixed batch (its result adds requests to `running` and rewrites their rows when their
    prompt goes to the prefix tree, and a chunked prefill's end samples the first token), and,
    asked by the scheduler, before a decode of requests that need real outputs (penalties, a
    grammar), before a retraction (it picks by real outputs) and before a cache flush.

    At most one batch is in flight at a step's start. Request rows freed while a launched batch
    may still read them are parked (with the launch number they wait for) so that no new
    request reuses them too early."""

    def __init__(self, sched: Scheduler, slots: int) -> None:
        self.sched = sched
        self.client = TpModelWorkerClient(sched.worker, slots)
        self.inflight: InFlight | None = None
        self._launched = self._completed = 0
        self._parked_rows: list[tuple[int, int]] = []

    @property
    def in_flight(self) -> bool:
        return self.inflight is not None

    def step(self) -> None:
        sched = self.sched
        if self.inflight is not None and self.inflight.batch.mode != ForwardMode.DECODE:
            self.resolve()
        batch = sched.get_next_batch_to_run()
        prev, self.inflight = self.inflight, None
        if batch is not None:
            self.inflight = self._launch(batch)
        if prev is not None:
            sched.stats.overlapped_steps += batch is not None
            self._complete(prev)
        if batch is None and sched.is_idle():
            sched.check_integrity()

    def resolve(self) -> bool:
        """Process the batch in flight, if any: the plain loop's state from here on."""
        if self.inflight is None:
            return False
        done, self.inflight = self.inflight, None
        self._complete(done)
        return True

    def free_row(self, row: int) -> None:
        """A launched batch may still read this row: park it until that batch is done."""
        if self._launched > self._completed:
            self._parked_rows.append((self._launched, row))
        else:
            self.sched.req_to_token_pool.free(row)

    def _launch(self, batch: ScheduleBatch) -> InFlight:
        futures = self.client.submit(batch.worker_batch)
        sampled = iter(futures)
        for req, samples in zip(batch.reqs, batch.samples):
            # The forward thread writes this KV before any later batch runs: later steps may
            # build on it now. The sampled token is known only by its placeholder until then.
            req.kv.cached_len = req.kv.device_len
            if samples:
                req.kv.future_token = next(sampled)
        self._launched += 1
        return InFlight(batch, self._launched, futures)

    def _complete(self, done: InFlight) -> None:
        """Wait for a launched batch (the oldest in flight) and process its result."""
        res = self.client.result()
        self._completed = done.seq
        pool = self.sched.req_to_token_pool
        for seq, row in self._parked_rows:
            if seq <= done.seq:
                pool.free(row)
        self._parked_rows = [(seq, row) for seq, row in self._parked_rows if seq > done.seq]
        self.sched.outputs.process_batch_result(done.batch, res, done.futures)

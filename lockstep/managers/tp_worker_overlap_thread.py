"""The model worker on a forward thread, for overlap scheduling (SGLang's tp_worker_overlap_thread).

The scheduler thread `submit`s batch N and goes on to process batch N-1's result and to prepare
batch N+1 while this thread runs batch N's forward and sampling. torch ops release the GIL, so
the two really run at once. Batches run strictly one at a time in submission order, so a batch
always sees the KV every earlier batch wrote, and `result()` returns results in that order.

Batch N+1 is built before batch N has sampled, so its decode inputs name the tokens it has not
sampled yet by *future-token placeholders*: negative ids `-i` that index `future_tokens[i]`.
Before each forward this thread swaps them for the real tokens (`torch.where`); after sampling
it writes the batch's own tokens into its placeholder slots. The slots are handed out by
`submit`, on the scheduler thread, from a counter: the same on every rank, never timing-bound.

On CUDA the thread runs on its own stream (the scheduler's input copies must not queue behind
the forward), after an event that `submit` records once the batch's inputs are written.
(Not yet run on a GPU: CPU is where this was built and tested.)
"""

from __future__ import annotations

import queue
import threading

import torch

from lockstep.managers.schedule_batch import ModelWorkerBatch
from lockstep.managers.tp_worker import GenerationBatchResult, TpModelWorker

Job = tuple[ModelWorkerBatch, int, int, "torch.cuda.Event | None"]


class TpModelWorkerClient:
    def __init__(self, worker: TpModelWorker, max_sampled_per_batch: int) -> None:
        self.worker = worker
        self.max_sampled = max_sampled_per_batch
        # A ring of slots, sized so that a batch's slots never overlap its predecessor's (whose
        # tokens it reads) even when the counter wraps. Slot 0 stays unused: -0 is not negative.
        self.num_slots = 3 * max_sampled_per_batch
        self.future_tokens = torch.zeros(self.num_slots + 1, dtype=torch.int64,
                                         device=worker.runner.device)
        self._next_slot = 1
        self._cuda = self.future_tokens.is_cuda
        self._cuda_device = torch.cuda.current_device() if self._cuda else None
        self._stream = torch.cuda.Stream() if self._cuda else None
        self._inputs: queue.Queue[Job] = queue.Queue()
        self._outputs: queue.Queue[GenerationBatchResult | BaseException] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="lockstep-forward").start()

    def submit(self, batch: ModelWorkerBatch) -> list[int]:
        """Queue `batch` for the forward thread; returns the placeholder id of each token it
        will sample (one per sampling row, in row order)."""
        n = int(batch.sample_rows.numel())
        if n > self.max_sampled:
            raise RuntimeError(f"a batch samples {n} tokens, more than the {self.max_sampled} "
                               "the future-token buffer was sized for")
        if self._next_slot + n > self.num_slots + 1:
            self._next_slot = 1
        first, self._next_slot = self._next_slot, self._next_slot + n
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record()  # on the scheduler's stream, after this batch's inputs
        self._inputs.put((batch, first, n, ready))
        return [-(first + i) for i in range(n)]

    def result(self) -> GenerationBatchResult:
        """Block until the oldest submitted batch is done; re-raise what the thread raised."""
        out = self._outputs.get()
        if isinstance(out, BaseException):
            raise RuntimeError("the forward thread failed") from out
        return out

    # ---- the forward thread -------------------------------------------------------------
    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self._cuda_device)
            torch.cuda.set_stream(self._stream)
        while True:  # a daemon thread: it ends with its scheduler process
            item = self._inputs.get()
            try:
                self._outputs.put(self._run(*item))
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                self._outputs.put(e)

    @torch.inference_mode()
    def _run(self, batch: ModelWorkerBatch, first_slot: int, n: int,
             ready: torch.cuda.Event | None) -> GenerationBatchResult:
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        fb = batch.forward_batch
        ids = fb.input_ids
        fb.input_ids = torch.where(ids < 0, self.future_tokens[(-ids).clamp(min=0)], ids)
        res = self.worker.forward_batch_generation(batch)
        if n:
            self.future_tokens[first_slot:first_slot + n] = torch.tensor(
                res.next_token_ids, dtype=torch.int64, device=self.future_tokens.device)
        return res

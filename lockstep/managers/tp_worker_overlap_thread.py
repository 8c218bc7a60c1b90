"""The model worker on a forward thread, for overlap scheduling (SGLang's tp_worker_overlap_thread):
the scheduler thread `submit`s batch N, then processes batch N-1's result and prepares N+1 while
this thread runs N (torch ops release the GIL). Batches run one at a time in submission order,
so each sees the KV every earlier one wrote, and `result()` returns results in that order.

Batch N+1 is built before N has sampled: its decode inputs name those tokens by *future-token
placeholders*, negative ids `-i` indexing `future_tokens[i]`, which this thread swaps for the
real tokens before each forward and fills in after sampling. `submit` hands the slots out from a
counter on the scheduler thread: the same on every rank, never timing-bound. On CUDA the thread
has its own stream, ordered after an event `submit` records (not yet run on a GPU)."""

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

"""Replicas added to and removed from a running `--dp-size` server (SGLang's elastic DP workers),
driven by the admin routes (admin_routes.py).

Adding: the replica's scheduler processes start like the launch's (same arguments, a dp_rank
never used before) and load the model; the DP controller then connects to it without dispatching
to it (`ReplicaChange add`), one short generation pinned to it warms it, and only then does it
take traffic (`activate`). Removing: the controller stops dispatching to it (`remove`); every
request in flight at that point (the ones it may hold) is let finish, since the messages to the
controller are ordered, nothing sent later goes there; then the controller forgets it
(`retire`) and its processes are stopped, taken off the list of children whose death would
bring the server down first. So no request is lost or sent twice. One change at a time."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import uuid

from lockstep.core import FINISH_ABORT
from lockstep.entrypoints.engine import READY_TIMEOUT_S, Launched, _wait_ready, replica_processes
from lockstep.entrypoints.tokenizer_manager import RequestError, TokenizerManager
from lockstep.lora.adapter import parse_lora_paths
from lockstep.managers.scheduler_process import run_scheduler_process
from lockstep.messages import (
    LoadLoraAdapterReq,
    ReplicaChange,
    TokenizedGenerateReq,
    UnloadLoraAdapterReq,
    encode,
)
from lockstep.sampling_params import SamplingParams
from lockstep.utils.process import kill_tree

DRAIN_POLL_S = 0.05


class ElasticReplicas:
    def __init__(self, launched: Launched) -> None:
        self.launched = launched
        self.lock = asyncio.Lock()
        self.procs: dict[int, list[mp.Process]] = {}  # the processes of each replica added here

    @property
    def tm(self) -> TokenizerManager:
        assert self.launched.tokenizer_manager is not None  # the HTTP server runs on node 0
        return self.launched.tokenizer_manager

    def _check(self) -> None:
        if self.launched.args.dp_size < 2 or self.launched.args.nnodes > 1:
            raise RequestError("replicas are added and removed on a server started with "
                               "--dp-size 2 or more (on one node)")

    async def _tell(self, op: str, dp_rank: int, input_ipc: str = "") -> None:
        await self.tm.to_scheduler.send(encode(ReplicaChange(op, dp_rank, input_ipc)))

    async def add(self) -> int:
        """Start a replica, warm it, put it to work: its dp_rank."""
        self._check()
        async with self.lock:
            tm, launched = self.tm, self.launched
            dp_rank = len(tm.replicas)
            rports = launched.ports.for_replica(dp_rank)
            ctx = mp.get_context("spawn")
            started = []
            for name, *rank_args in replica_processes(launched.args, rports, dp_rank):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=run_scheduler_process, name=name, args=tuple(rank_args),
                                kwargs={"dp_rank": dp_rank, "pipe": writer})
                p.start()
                started.append((p, reader))
            procs = [p for p, _ in started]
            launched.children.extend(procs)  # a death from here on takes the server down
            try:
                await asyncio.to_thread(lambda: [_wait_ready(p, r, READY_TIMEOUT_S)
                                                 for p, r in started])
            except Exception as e:
                self._stop(procs)
                raise RequestError(f"the new replica did not start: {e}", status=500) from None
            self.procs[dp_rank] = procs
            tm.replicas.append("warming")
            await self._tell("add", dp_rank, rports.scheduler_input_ipc)
            await self._same_adapters(dp_rank)
            await self._warm(dp_rank)
            await self._tell("activate", dp_rank)
            tm.replicas[dp_rank] = "active"
            return dp_rank

    async def _same_adapters(self, dp_rank: int) -> None:
        """The new replica started with --lora-paths; load and unload what the others did since."""
        tm = self.tm
        started, now = parse_lora_paths(self.launched.args.lora_paths), dict(tm.lora_adapters)
        changes: list[LoadLoraAdapterReq | UnloadLoraAdapterReq] = [
            *(UnloadLoraAdapterReq(n, dp_rank=dp_rank) for n in started if started[n] != now.get(n)),
            *(LoadLoraAdapterReq(n, p, dp_rank=dp_rank) for n, p in now.items() if started.get(n) != p)]
        for msg in changes:
            out = await tm.update_lora(msg)
            if not out.success:
                raise RequestError(f"replica {dp_rank}: {out.message}", status=500)

    async def _warm(self, dp_rank: int) -> None:
        """One short greedy generation on the new replica before it takes traffic."""
        tok = self.tm.tokenizer
        first = tok.bos_token_id if tok.bos_token_id is not None else 0
        req = TokenizedGenerateReq(f"warmup-{uuid.uuid4().hex}", [first],
                                   SamplingParams(max_new_tokens=2, temperature=0.0),
                                   routed_dp_rank=dp_rank)
        last = None
        async for out in self.tm.generate(req):
            last = out
        if last is None or isinstance(last.finish_reason, FINISH_ABORT):
            raise RequestError(f"replica {dp_rank} failed its warm-up generation", status=500)

    async def remove(self, dp_rank: int) -> None:
        """Stop dispatching to the replica, let what it holds finish, then stop it."""
        self._check()
        async with self.lock:
            tm = self.tm
            if not 0 <= dp_rank < len(tm.replicas) or tm.replicas[dp_rank] != "active":
                raise RequestError(f"no active replica {dp_rank}", status=404)
            if tm.replicas.count("active") == 1:
                raise RequestError("that is the last active replica; add one first")
            tm.replicas[dp_rank] = "draining"
            await self._tell("remove", dp_rank)
            # What it may hold was sent before that message, so is in flight now (a request is
            # tracked before it is sent); what is sent from now on goes to the others.
            in_flight = set(tm.states)
            while in_flight & tm.states.keys():
                await asyncio.sleep(DRAIN_POLL_S)
            await self._tell("retire", dp_rank)
            procs = self.procs.pop(dp_rank, None)
            if procs is None:  # one of the launch's replicas
                procs = [p for p in self.launched.children
                         if p.name.startswith(f"scheduler-DP{dp_rank}-")]
            await asyncio.to_thread(self._stop, procs)
            tm.replicas[dp_rank] = "retired"

    def _stop(self, procs: list[mp.Process]) -> None:
        for p in procs:
            if p in self.launched.children:
                self.launched.children.remove(p)  # off the watch before it dies
        for p in procs:
            if p.is_alive():
                kill_tree(p.pid)
        for p in procs:
            p.join(timeout=10)

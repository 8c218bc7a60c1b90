"""The data-parallel controller: one process in front of dp_size replicas. It reads the
tokenizer manager's inputs and sends each request to one replica by the load-balance method, or
to the one it names (`routed_dp_rank`). Each replica's input rank reports its load after a step
whenever it changed (lockstep.messages.LoadReport: running and queued requests, KV in use, prompt
tokens still to compute, and how many requests it has read); the controller adds what it sent
that the report has not seen yet, so dispatch follows the replicas' real queues, and a burst sent
between two reports is not all counted as nothing (SGLang's DPBudget)."""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import takewhile
from multiprocessing.connection import Connection
from typing import Any

import zmq

from lockstep.messages import (
    AbortReq,
    FlushCacheReq,
    LoadLoraAdapterReq,
    LoadReport,
    ReplicaChange,
    TokenizedGenerateReq,
    UnloadLoraAdapterReq,
    decode,
    encode,
    recv_all,
    zmq_socket,
)
from lockstep.server_args import PortArgs, ServerArgs
from lockstep.utils.cache_aware import CacheAwareRule
from lockstep.utils.process import exit_on_error, start_child
from lockstep.utils.watchdog import ForwardProgressWatchdog

logger = logging.getLogger(__name__)
BLOCK = 16  # tokens per node of the approximate prefix index
MAX_BLOCKS = 1 << 16  # blocks that index keeps per replica
MAX_TRACKED_RIDS = 100_000


@dataclass
class ReplicaState:
    running: int = 0
    queued: int = 0
    tokens_in_use: int = 0
    queued_tokens: int = 0
    sent: int = 0  # requests dispatched here in all
    # Prompt lengths of the requests dispatched here that the last report had not seen: counted
    # as load too (the budget a burst spends before the replica's next report).
    unseen: deque = field(default_factory=deque)
    # Approximate prefix index of what was sent here: hash chain of 16-token blocks, LRU-bounded.
    blocks: OrderedDict = field(default_factory=OrderedDict)
    active: bool = True  # dispatched to; a replica added while serving starts inactive (warming)

    @property
    def load(self) -> int:
        """Requests: running, queued, and sent but not yet seen."""
        return self.running + self.queued + len(self.unseen)

    @property
    def backlog(self) -> int:
        """Prompt tokens still to compute here, of what it holds and what it has not seen yet:
        the prefill a request sent here now waits for before its first token."""
        return self.queued_tokens + sum(self.unseen)


# Each load-balance method that picks the replica with the least of something: what it counts.
# total_requests and total_tokens are SGLang's names for its DPBudget methods; shortest_queue is
# the older name of total_requests, minimum_tokens counts KV in use only. total_tokens counts the
# prompt tokens still to compute first, KV in use second: a long prompt's KV costs a decoding
# request little more per step, but its prefill holds up every request queued behind it.
LEAST = {
    "shortest_queue": lambda s: s.load,
    "total_requests": lambda s: s.load,
    "minimum_tokens": lambda s: (s.tokens_in_use, s.load),
    "total_tokens": lambda s: (s.backlog, s.tokens_in_use, s.load),
}


class Dispatcher:
    """Chooses a replica for each request. Pure given its inputs (reports and requests)."""

    def __init__(self, method: str, dp_size: int, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.0001) -> None:
        self.method = method
        self.replicas = [ReplicaState() for _ in range(dp_size)]
        self.rule = CacheAwareRule(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self.next_rr = 0

    def report(self, r: LoadReport) -> None:
        if r.dp_rank >= len(self.replicas):  # a replica started, not yet added: nothing sent
            return
        s = self.replicas[r.dp_rank]
        s.running, s.queued, s.tokens_in_use, s.queued_tokens = (
            r.running, r.queued, r.tokens_in_use, r.queued_tokens)
        while len(s.unseen) > s.sent - r.received:  # the oldest are those it has read
            s.unseen.popleft()

    def choose(self, req: TokenizedGenerateReq) -> int:
        if req.routed_dp_rank is not None:  # checked against the live replicas by the front
            target = req.routed_dp_rank
        elif self.method == "round_robin":
            live = self.active()
            target = next((i for i in live if i >= self.next_rr), live[0])
            self.next_rr = target + 1
        elif self.method in LEAST:
            target = self._least(LEAST[self.method])
        elif self.method == "cache_aware":
            target = self._cache_aware(req.input_ids)
        else:
            raise ValueError(f"unknown load-balance method {self.method!r}")
        s = self.replicas[target]
        s.sent += 1
        s.unseen.append(len(req.input_ids or ()))
        return target

    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.replicas) if s.active]

    def _least(self, key) -> int:
        return min(self.active(), key=lambda i: (key(self.replicas[i]), i))

    def _cache_aware(self, ids: list[int]) -> int:
        chain, h = [], 0  # a hash per whole block, each covering every block before it
        for i in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
            h = hash((h, tuple(ids[i:i + BLOCK])))
            chain.append(h)
        live = [self.replicas[i] for i in self.active()]
        matched = [sum(1 for _ in takewhile(s.blocks.__contains__, chain)) * BLOCK / max(1, len(ids))
                   for s in live]
        pick, _why = self.rule.choose([s.load for s in live], matched, [len(s.blocks) for s in live])
        target = self.active()[pick]
        blocks = self.replicas[target].blocks  # what is sent there is (soon) cached there
        for h in chain:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > MAX_BLOCKS:
            blocks.popitem(last=False)
        return target


def run_data_parallel_controller(args: ServerArgs, ports: PortArgs, replica_inputs: list[str],
                                 pipe: Connection) -> None:
    start_child("data_parallel_controller", args.log_level, "DP")
    with exit_on_error("data-parallel controller", pipe):
        ctx = zmq.Context()
        inputs = zmq_socket(ctx, zmq.PULL, ports.scheduler_input_ipc)
        loads = zmq_socket(ctx, zmq.PULL, ports.dp_load_ipc)
        outs: list[zmq.Socket | None] = [zmq_socket(ctx, zmq.PUSH, a) for a in replica_inputs]
        dispatcher = Dispatcher(args.load_balance_method, args.dp_size, args.dp_cache_threshold,
                                args.dp_balance_abs_threshold, args.dp_balance_rel_threshold)
    pipe.send({"status": "ready"})
    owner: OrderedDict[str, int] = OrderedDict()
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    poller.register(loads, zmq.POLLIN)
    watchdog = ForwardProgressWatchdog(args.watchdog_timeout, "data-parallel controller").start()
    with exit_on_error("data-parallel controller"):
        while True:
            ready = dict(poller.poll())
            watchdog.step_begins(True)
            msg = decode(inputs.recv()) if inputs in ready else None
            for report in recv_all(loads):  # before routing: whatever arrived until now counts
                dispatcher.report(report)
            if isinstance(msg, ReplicaChange):
                _change(msg, dispatcher, outs, ctx)
            elif msg is not None:
                _route(msg, dispatcher, outs, owner)
            watchdog.step_done(False)


def _change(msg: ReplicaChange, dispatcher: Dispatcher, outs: list[zmq.Socket | None],
            ctx: zmq.Context) -> None:
    """A replica added, put to work, taken off dispatch, or forgotten (entrypoints/elastic.py)."""
    if msg.op == "add":
        outs.append(zmq_socket(ctx, zmq.PUSH, msg.input_ipc))
        dispatcher.replicas.append(ReplicaState(active=False))
    elif msg.op in ("activate", "remove"):
        dispatcher.replicas[msg.dp_rank].active = msg.op == "activate"
    elif msg.op == "retire":  # its processes are gone: nothing may queue for it
        sock, outs[msg.dp_rank] = outs[msg.dp_rank], None
        if sock is not None:
            sock.close(linger=0)
    logger.info("replica %d: %s", msg.dp_rank, msg.op)


def _route(msg: Any, dispatcher: Dispatcher, outs: list[zmq.Socket | None],
           owner: OrderedDict) -> None:
    if isinstance(msg, TokenizedGenerateReq):
        target = dispatcher.choose(msg)
        owner[msg.rid] = target
        if len(owner) > MAX_TRACKED_RIDS:
            owner.popitem(last=False)
        outs[target].send(encode(msg))
    elif isinstance(msg, AbortReq) and msg.rid in owner:
        if (sock := outs[owner[msg.rid]]) is not None:
            sock.send(encode(msg))
    elif isinstance(msg, (LoadLoraAdapterReq, UnloadLoraAdapterReq)) and msg.dp_rank is not None:
        if (sock := outs[msg.dp_rank]) is not None:
            sock.send(encode(msg))
    elif isinstance(msg, (AbortReq, FlushCacheReq, LoadLoraAdapterReq, UnloadLoraAdapterReq)):
        for s in outs:
            if s is not None:
                s.send(encode(msg))
    else:
        logger.error("DP controller ignored %s", type(msg).__name__)

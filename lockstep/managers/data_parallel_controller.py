"""The data-parallel controller: one process in front of dp_size replicas. It reads the
tokenizer manager's inputs and sends each request to one replica by the load-balance method;
replicas report their load back, so dispatch follows real queues rather than guesses."""

from __future__ import annotations

import logging
from collections import OrderedDict
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
    sent_since_report: int = 0  # dispatched after the last report: counted as load too
    # Approximate prefix index of what was sent here: hash chain of 16-token blocks, LRU-bounded.
    blocks: OrderedDict = field(default_factory=OrderedDict)

    @property
    def load(self) -> int:
        return self.running + self.queued + self.sent_since_report


class Dispatcher:
    """Chooses a replica for each request. Pure given its inputs (reports and requests)."""

    def __init__(self, method: str, dp_size: int, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.0001) -> None:
        self.method = method
        self.replicas = [ReplicaState() for _ in range(dp_size)]
        self.rule = CacheAwareRule(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self.next_rr = 0

    def report(self, r: LoadReport) -> None:
        s = self.replicas[r.dp_rank]
        s.running, s.queued, s.tokens_in_use, s.sent_since_report = r.running, r.queued, r.tokens_in_use, 0

    def choose(self, req: TokenizedGenerateReq) -> int:
        if self.method == "round_robin":
            target = self.next_rr
            self.next_rr = (self.next_rr + 1) % len(self.replicas)
        elif self.method == "shortest_queue":
            target = self._least(lambda s: s.load)
        elif self.method == "minimum_tokens":
            target = self._least(lambda s: (s.tokens_in_use, s.load))
        elif self.method == "cache_aware":
            target = self._cache_aware(req.input_ids)
        else:
            raise ValueError(f"unknown load-balance method {self.method!r}")
        self.replicas[target].sent_since_report += 1
        return target

    def _least(self, key) -> int:
        return min(range(len(self.replicas)), key=lambda i: (key(self.replicas[i]), i))

    def _cache_aware(self, ids: list[int]) -> int:
        chain, h = [], 0  # a hash per whole block, each covering every block before it
        for i in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
            h = hash((h, tuple(ids[i:i + BLOCK])))
            chain.append(h)
        matched = [sum(1 for _ in takewhile(s.blocks.__contains__, chain)) * BLOCK / max(1, len(ids))
                   for s in self.replicas]
        target, _why = self.rule.choose([s.load for s in self.replicas], matched,
                                        [len(s.blocks) for s in self.replicas])
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
        outs = [zmq_socket(ctx, zmq.PUSH, addr) for addr in replica_inputs]
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
            if msg is not None:
                _route(msg, dispatcher, outs, owner)
            watchdog.step_done(False)


def _route(msg: Any, dispatcher: Dispatcher, outs: list[zmq.Socket], owner: OrderedDict) -> None:
    if isinstance(msg, TokenizedGenerateReq):
        target = dispatcher.choose(msg)
        owner[msg.rid] = target
        if len(owner) > MAX_TRACKED_RIDS:
            owner.popitem(last=False)
        outs[target].send(encode(msg))
    elif isinstance(msg, AbortReq) and msg.rid in owner:
        outs[owner[msg.rid]].send(encode(msg))
    elif isinstance(msg, (AbortReq, FlushCacheReq, LoadLoraAdapterReq, UnloadLoraAdapterReq)):
        for s in outs:
            s.send(encode(msg))
    else:
        logger.error("DP controller ignored %s", type(msg).__name__)

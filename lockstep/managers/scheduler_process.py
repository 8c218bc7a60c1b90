"""A scheduler process: one per (pp_rank, tp_rank). Rank 0 reads inputs and broadcasts them;
every rank then runs the same Scheduler step; rank 0 sends the outputs on."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from lockstep.distributed.communication import (
    all_gather_pyobj,
    broadcast_pyobj,
    init_distributed,
    make_pipeline_group,
    make_tp_group,
    make_world_group,
)
from lockstep.distributed.parallel_state import ParallelGroup
from lockstep.managers.scheduler import Scheduler, create_scheduler
from lockstep.messages import (
    BatchTokenIDOut,
    LoadReport,
    TokenizedGenerateReq,
    encode,
    recv_all,
    zmq_socket,
)
from lockstep.model_executor.weight_setup import weight_bytes
from lockstep.server_args import PortArgs, ServerArgs
from lockstep.utils.process import exit_on_error, start_child
from lockstep.utils.watchdog import ForwardProgressWatchdog

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 500


class LockstepError(RuntimeError):
    pass


def run_scheduler_process(args: ServerArgs, ports: PortArgs, tp_rank: int, pp_rank: int,
                          threads: int, pipe: Connection, dp_rank: int = 0) -> None:
    name = (f"DP{dp_rank} " if args.dp_size > 1 else "") + f"TP{tp_rank}" + (
        f" PP{pp_rank}" if args.pp_size > 1 else "")
    start_child(f"scheduler {name}", args.log_level, name)
    torch.set_num_threads(threads)
    with exit_on_error(f"scheduler TP{tp_rank}", pipe):
        world, global_rank = args.tp_size * args.pp_size, pp_rank * args.tp_size + tp_rank
        if world > 1:
            init_distributed(ports.dist_init_addr, world, global_rank, args.device)
        world_group = make_world_group(world, global_rank)
        tp = make_tp_group(args.tp_size, tp_rank, pp_rank, args.pp_size, args.device)
        pp = make_pipeline_group(args.tp_size, args.pp_size, tp_rank, pp_rank, world_group)
        local_ranks = max(1, world // args.nnodes)
        sched = create_scheduler(args, tp, pp, local_ranks=local_ranks * args.dp_size, dp_rank=dp_rank)
        ctx = zmq.Context()
        recv = send = load = None
        if global_rank == 0:  # the one rank that reads inputs and sends outputs
            recv = zmq_socket(ctx, zmq.PULL, ports.scheduler_input_ipc)
            send = zmq_socket(ctx, zmq.PUSH, ports.detokenizer_ipc)
            if args.dp_size > 1:
                load = zmq_socket(ctx, zmq.PUSH, ports.dp_load_ipc)
    pipe.send({"status": "ready", "max_total_num_tokens": sched.max_total_tokens,
               "context_len": sched.context_len, "tp_rank": tp_rank, "pp_rank": pp_rank,
               "param_bytes": weight_bytes(sched.worker.runner.model),
               "weight_plan": sched.worker.runner.weight_plan.summary()})
    with exit_on_error(f"scheduler TP{tp_rank}"):
        event_loop(args, sched, world_group, recv, send, load)


def recv_requests(sock: zmq.Socket | None, block: bool) -> list[Any]:
    if sock is None or (block and not sock.poll(IDLE_POLL_MS)):
        return []
    return recv_all(sock)


def event_loop(args: ServerArgs, sched: Scheduler, world: ParallelGroup, recv: zmq.Socket | None,
               send: zmq.Socket | None, load: zmq.Socket | None = None) -> None:
    if args.enable_lockstep_check:
        sched.before_run = lockstep_checker(args.enable_lockstep_check, world)
    # A busy scheduler that finishes no step for --watchdog-timeout s takes the server down.
    watchdog = ForwardProgressWatchdog(args.watchdog_timeout, mp.current_process().name).start()
    last_load: tuple[int, ...] | None = None
    received = 0  # generate requests read so far: the DP controller's count of what this one saw
    # sched.run_step runs the overlap loop (model on a forward thread, previous result processed
    # while it computes) or the plain one; either way one call is one deterministic step.
    logger.info("step loop: %s", "overlap" if sched.overlap else "plain")
    while True:
        msgs = recv_requests(recv, block=sched.is_idle())
        received += sum(isinstance(m, TokenizedGenerateReq) for m in msgs)
        if recv is not None:  # the input rank: what it read, then which grammars are ready
            msgs = sched.collect_inputs(msgs)
        msgs = broadcast_pyobj(msgs, world)
        watchdog.step_begins(bool(msgs) or not sched.is_idle())
        outputs = sched.run_step(msgs)
        watchdog.step_done(not sched.is_idle())
        if load is not None:
            # Before the outputs: a client that reacts to an output by sending its next request
            # reaches the DP controller after this report, so dispatch sees the finished load.
            now = (*sched.load(), received)
            if now != last_load:
                load.send(encode(LoadReport(sched.dp_rank, *now)))
                last_load = now
        if send is not None:
            if outputs:
                send.send(encode(BatchTokenIDOut(outputs)))
            for reply in sched.control_replies:
                send.send(encode(reply))
        sched.control_replies.clear()


def lockstep_checker(every: int, world: ParallelGroup):
    """Every `every` steps the ranks compare a running hash of their schedule decisions, and fail
    with both fingerprints instead of hanging in a collective with mismatched batches."""
    state = {"digest": ""}

    def check(step: int, fingerprint: str) -> None:
        state["digest"] = hashlib.sha1((state["digest"] + fingerprint).encode()).hexdigest()[:16]
        if step % every:
            return
        seen = all_gather_pyobj(state["digest"], world)
        if len(set(seen)) > 1:
            raise LockstepError(
                f"lockstep check failed at step {step}: ranks made different scheduling decisions; "
                f"fingerprints by rank: {seen}")

    return check

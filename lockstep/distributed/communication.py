"""Control-path collectives. Only *inputs* cross between ranks: never a batch."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lockstep.distributed.parallel_state import ParallelGroup, PipelineGroup


def init_distributed(init_addr: str, world_size: int, rank: int, device: str) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", world_size=world_size,
                            rank=rank, timeout=timedelta(hours=24))


def make_tp_group(tp_size: int, tp_rank: int, pp_rank: int, pp_size: int, device: str) -> ParallelGroup:
    if tp_size == 1:
        return ParallelGroup()
    mine = None
    # new_group is collective over the whole world: every rank creates every stage's group, in
    # the same order, and keeps its own.
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        device_group = dist.new_group(ranks, backend="nccl" if device == "cuda" else "gloo")
        cpu_group = device_group if device != "cuda" else dist.new_group(ranks, backend="gloo")
        if stage == pp_rank:
            mine = ParallelGroup(tp_rank, tp_size, device_group, cpu_group, ranks[0], ranks[0] + tp_rank)
    return mine


def make_world_group(world_size: int, global_rank: int) -> ParallelGroup:
    """Every rank of the replica, on gloo: inputs, sampled tokens and lockstep checks."""
    if world_size == 1:
        return ParallelGroup()
    cpu = dist.new_group(list(range(world_size)), backend="gloo")
    return ParallelGroup(global_rank, world_size, cpu, cpu, 0, global_rank)


def make_pipeline_group(args_tp: int, args_pp: int, tp_rank: int, pp_rank: int,
                        world: ParallelGroup) -> PipelineGroup:
    if args_pp == 1:
        return PipelineGroup(world=world)
    me = pp_rank * args_tp + tp_rank
    return PipelineGroup(
        rank=pp_rank, size=args_pp,
        prev_global=me - args_tp if pp_rank > 0 else -1,
        next_global=me + args_tp if pp_rank < args_pp - 1 else -1,
        last_stage_src=(args_pp - 1) * args_tp, world=world,
    )


def broadcast_pyobj(obj: Any, group: ParallelGroup, src: int | None = None) -> Any:
    """Global rank `src` (default: the group's first rank) sends `obj`; every rank returns it.
    Length first, then bytes, so an empty step costs one 8-byte broadcast."""
    if group.size == 1:
        return obj
    src = group.first_global_rank if src is None else src
    sending = group.global_rank == src
    data = pickle.dumps(obj) if sending and obj else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group.cpu_group)
    if int(size) == 0:  # the sender's empty obj; elsewhere an empty one of the local obj's type
        return obj if sending or obj is None else obj.__class__()
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if sending
           else torch.empty(int(size), dtype=torch.uint8))
    dist.broadcast(buf, src=src, group=group.cpu_group)
    return obj if sending else pickle.loads(buf.numpy().tobytes())


def all_gather_pyobj(obj: Any, group: ParallelGroup) -> list[Any]:
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out

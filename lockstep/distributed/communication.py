"""Control-path collectives. Only *inputs* cross between ranks: never a batch."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lockstep.distributed.parallel_state import ParallelGroup


def init_distributed(init_addr: str, world_size: int, rank: int, device: str) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", world_size=world_size,
                            rank=rank, timeout=timedelta(hours=24))


def make_tp_group(tp_size: int, tp_rank: int, pp_rank: int, device: str) -> ParallelGroup:
    if tp_size == 1:
        return ParallelGroup()
    ranks = list(range(pp_rank * tp_size, (pp_rank + 1) * tp_size))
    device_group = dist.new_group(ranks, backend="nccl" if device == "cuda" else "gloo")
    cpu_group = device_group if device != "cuda" else dist.new_group(ranks, backend="gloo")
    return ParallelGroup(tp_rank, tp_size, device_group, cpu_group, ranks[0])


def broadcast_pyobj(obj: Any, group: ParallelGroup) -> Any:
    """Rank 0 of the group sends `obj`; every rank returns it. Length first, then bytes, so an
    empty step costs one 8-byte broadcast."""
    if group.size == 1:
        return obj
    if group.rank == 0:
        data = pickle.dumps(obj) if obj else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=group.first_global_rank, group=group.cpu_group)
        if data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.broadcast(buf, src=group.first_global_rank, group=group.cpu_group)
        return obj
    size = torch.tensor([0], dtype=torch.int64)
    dist.broadcast(size, src=group.first_global_rank, group=group.cpu_group)
    if int(size) == 0:
        return []
    buf = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=group.first_global_rank, group=group.cpu_group)
    return pickle.loads(buf.numpy().tobytes())


def all_gather_pyobj(obj: Any, group: ParallelGroup) -> list[Any]:
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out

"""Process groups, passed explicitly to every layer that needs one (no global context).

A `ParallelGroup` of size 1 runs no collective at all, so single-rank serving never touches
torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    # Group for tensors on the model's device (gloo on CPU, NCCL on CUDA).
    device_group: dist.ProcessGroup | None = None
    # Gloo group for control traffic (pickled inputs, fingerprints), whatever the device.
    cpu_group: dist.ProcessGroup | None = None
    # Global rank of this group's rank 0, the source of broadcasts.
    first_global_rank: int = 0
    # This process's global rank.
    global_rank: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def shard_range(self, total: int) -> tuple[int, int]:
        """The [start, end) slice of a dimension of `total` this rank holds (total % size == 0)."""
        if total % self.size:
            raise ValueError(f"dimension {total} is not divisible by tp size {self.size}")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per


SINGLE = ParallelGroup()


def partition_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the layers pipeline stage `pp_rank` runs; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


@dataclass(frozen=True)
class PipelineGroup:
    """This rank's place in the pipeline. Hidden states go to the same TP rank of the next stage;
    the last stage's TP rank 0 broadcasts sampled tokens to every rank of the replica (`world`)."""

    rank: int = 0
    size: int = 1
    prev_global: int = -1
    next_global: int = -1
    last_stage_src: int = 0
    world: ParallelGroup = ParallelGroup()

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


NO_PIPELINE = PipelineGroup()

"""Process groups, passed explicitly to every layer that needs one (no global context).

A `ParallelGroup` of size 1 runs no collective at all, so single-rank serving never touches
torch.distributed.
"""

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

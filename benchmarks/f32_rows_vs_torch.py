"""A float checkpoint's float32 weights as F32 rows on the exact kernel (the weight plan's choice on a
CPU, batch invariant) vs torch's float32 matmul (what served them before, whose reduction order
follows the batch): microseconds per call, best of 3 rounds, at the tiny test model's and
SmolLM2-135M's linear shapes.

    python benchmarks/f32_rows_vs_torch.py [THREADS]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lockstep import kernels

SHAPES = {"tiny qkv": (128, 64), "tiny down": (64, 128), "smol qkv": (960, 576), "smol gate_up": (3072, 576),
          "smol down": (576, 1536), "smol head": (49152, 576)}  # name: (N, K)


def best_us(f: Callable[[], object], reps: int) -> float:
    f()
    f()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    print(f"variant {kernels.kernel_variant()}, {torch.get_num_threads()} thread(s)")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        rows = w.view(torch.uint8)
        for m in (1, 4, 32):
            x = torch.randn(m, k)
            reps = max(3, int(2e7 / (n * k * max(m, 4))))
            a = best_us(lambda: F.linear(x, w), reps)  # noqa: B023
            b = best_us(lambda: kernels.linear(x, rows, kernels.BlockType.F32, k), reps)  # noqa: B023
            print(f"{name:13s} N={n:6d} K={k:5d} M={m:3d}  torch {a:9.1f} us  F32 rows {b:9.1f} us  {b / a:5.2f}x")


if __name__ == "__main__":
    main()

"""The int8 kernel alone on the default GGUF's tensors at a few row counts: min-of-N ms of one
variant's linear_int8, `T` threads (default 1: CPU-bound, so it holds on a shared machine), on the
GGUF's blocks and, for the types the int8 path unpacks at load, on the layout it serves
(kernels.unpack_for_int8). Run it in two source trees (PYTHONPATH) back to back to compare a kernel
change.

    T=1 python benchmarks/int8_kernel_rows.py avx2 1,4,8,9,64,256 7
"""

from __future__ import annotations

import os
import sys
import time

import torch
from kernel_bench import gguf_cases

from lockstep.kernels import block_type, unpack_for_int8
from lockstep.kernels.build import load_variant


def main() -> None:
    variant, ms, reps = sys.argv[1], [int(a) for a in sys.argv[2].split(",")], int(sys.argv[3])
    torch.set_num_threads(int(os.environ.get("T", "1")))
    mod = load_variant(variant)
    torch.manual_seed(0)
    for label, stored, stored_type, k in gguf_cases():
        served = unpack_for_int8(stored_type, stored, k)
        layouts = [(block_type(stored_type), stored)] + ([served] if served[0] != stored_type else [])
        for qtype, blocks in layouts:
            for m in ms:
                x = torch.randn(m, k)
                mod.linear_int8(x, blocks, qtype.code, k)
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    mod.linear_int8(x, blocks, qtype.code, k)
                    times.append(time.perf_counter() - t)
                print(f"{label.split()[0]:18s} {qtype:8s} m={m:3d} {min(times) * 1e3:9.3f} ms", flush=True)


if __name__ == "__main__":
    main()

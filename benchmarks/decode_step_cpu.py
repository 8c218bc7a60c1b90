"""CPU time per in-process decode step: a figure that holds on a shared machine, where wall times
of multi-threaded steps do not (each OpenMP join waits for a descheduled thread).

    python benchmarks/decode_step_cpu.py BATCH [STEPS] [THREADS]

Default model and flags, in-process scheduler; prompts of 128 random ids; prints the median and
minimum wall and CPU (`time.process_time`, all threads) milliseconds of STEPS decode steps. With
THREADS=1 (the default) CPU time is the work itself; run the trees to compare interleaved.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from lockstep.bench.one_batch import LockstepBench
from lockstep.testing.inproc import greedy_req


def main() -> None:
    batch = int(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    bench = LockstepBench(None, "auto", batch, 128, steps + 8, 0)
    prompts = [[random.Random(i).randrange(1000, 20000) for _ in range(128)] for i in range(batch)]
    bench.run(prompts, 8)  # warm-up
    sched = bench.sched
    sched.step([greedy_req(f"p{i}", p, steps + 8) for i, p in enumerate(prompts)])
    for _ in range(3):
        sched.step()
    wall, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        sched.step()
        wall.append(1000 * (time.perf_counter() - t))
        cpu.append(1000 * (time.process_time() - c))
    print(f"batch {batch}: wall median {statistics.median(wall):.2f} min {min(wall):.2f} ms | "
          f"cpu median {statistics.median(cpu):.2f} min {min(cpu):.2f} ms")


if __name__ == "__main__":
    main()

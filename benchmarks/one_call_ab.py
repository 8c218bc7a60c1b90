"""One compiled call per decoder layer vs the modules, interleaved on one scheduler: CPU ms per
decode step (time.process_time, so it holds on a shared machine), the default model and flags.

    python benchmarks/one_call_ab.py BATCH [THREADS]
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
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    bench = LockstepBench(None, "auto", batch, 128, 200, 0)
    prompts = [[random.Random(i).randrange(1000, 20000) for _ in range(128)] for i in range(batch)]
    bench.run(prompts, 8)  # warm-up
    sched = bench.sched
    model = sched.worker.runner.model
    plans = model.one_call_args
    times: dict[str, list[float]] = {"one call": [], "modules": []}
    sched.step([greedy_req(f"p{i}", p, 150) for i, p in enumerate(prompts)])
    sched.step()
    for _ in range(6):
        for mode, args in (("one call", plans), ("modules", [None] * len(plans))):
            model.one_call_args = args
            for _ in range(8):
                t = time.process_time()
                sched.step()
                times[mode].append(time.process_time() - t)
    for mode, v in times.items():
        print(f"batch {batch}, {mode}: median {statistics.median(v) * 1e3:.2f} ms, min {min(v) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

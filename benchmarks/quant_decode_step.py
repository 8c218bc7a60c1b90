"""CPU milliseconds per one-user decode step on a GGUF, one thread (a figure that holds on a shared
machine, where wall times do not):

    python benchmarks/quant_decode_step.py MODEL.gguf [int8|exact] [STEPS]

In-process scheduler, a 64-id random prompt, greedy; prints the median CPU ms per step and the
tok/s it makes on one thread. docs/quant_types.md quotes it for SmolLM2-135M-Instruct Q4_1.
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
    path, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "int8"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    torch.set_num_threads(1)
    bench = LockstepBench(path, "auto", 1, 64, steps + 8, 0, int8_activations=mode == "int8")
    prompt = [random.Random(0).randrange(1000, 20000) for _ in range(64)]
    sched = bench.sched
    sched.step([greedy_req("p", prompt, steps + 8)])
    for _ in range(3):
        sched.step()
    cpu = []
    for _ in range(steps):
        c = time.process_time()
        sched.step()
        cpu.append(1000 * (time.process_time() - c))
    ms = statistics.median(cpu)
    print(f"{mode}: cpu median {ms:.2f} ms per decode step = {1000 / ms:.1f} tok/s on one thread")


if __name__ == "__main__":
    main()

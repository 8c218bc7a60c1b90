"""Where a long prompt's prefill goes: torch-profiler self CPU time by op group for one prompt, prefilled
in chunks as the server does it (default flags and model, in-process scheduler, the layers run module by
module so the profiler sees each kernel; the one-call layers cost the same), and the unprofiled wall time.

    python benchmarks/prefill_profile.py [--prompt-len 2048] [--chunk 512] [--kv-cache-dtype float32]
"""

from __future__ import annotations

import argparse
import time

from decode_step_profile import group_ms, label_kernels
from torch.profiler import profile

from lockstep.bench.datasets import load_tokenizer
from lockstep.bench.one_batch import make_prompts
from lockstep.managers.scheduler import create_scheduler
from lockstep.model_loader import resolve_model
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import greedy_req


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512, help="chunked_prefill_size (-1: one step)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    args = p.parse_args()
    label_kernels()
    n = args.prompt_len
    prompts = make_prompts(load_tokenizer(str(resolve_model(None).model_dir)), 4, n, 0)
    sched = create_scheduler(ServerArgs(
        max_running_requests=1, max_total_tokens=n + 256, chunked_prefill_size=args.chunk,
        disable_radix_cache=True, enable_overlap_schedule=False, kv_cache_dtype=args.kv_cache_dtype))
    for m in sched.worker.runner.model.modules():  # module by module: the profiler sees each kernel
        if hasattr(m, "one_call_args"):
            m.one_call_args = [None] * len(m.one_call_args)

    def prefill(tag: str, prompt: list[int]) -> float:
        t = time.perf_counter()
        sched.step([greedy_req(tag, prompt, 1)])
        while not sched.is_idle():
            sched.step()
        return (time.perf_counter() - t) * 1e3

    prefill("warm", prompts[0])
    walls = [prefill(f"w{i}", prompts[i]) for i in (1, 2)]
    with profile() as prof:
        prefill("profiled", prompts[3])
    ms, total = group_ms(prof, 1)
    print(f"{n}-token prompt, chunks of {args.chunk}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in ms.items() if v)
          + f"; all ops {total:.0f} ms; wall {min(walls):.0f} ms (unprofiled, best of 2)")


if __name__ == "__main__":
    main()

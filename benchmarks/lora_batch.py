"""LoRA's cost in a batch: W-batch decoding (32 concurrent requests) on the base model alone,
against the same load spread over 8 adapters (rank 16, every linear layer), side by side in one
run; and one user's inter-token latency with and without an adapter. Schedulers in this process
(the model and the scheduler, no IPC), plain decoding (no speculation), greedy, ignore_eos. Batch
runs alternate (base, adapters, base, ...); the one-user cases decode side by side step for step,
each on its own scheduler (the plain server, the LoRA server's base, the LoRA server with an
adapter; none of them serves the batches), so that the three see the same machine from one step
to the next (a one-user step is a few milliseconds, and this shared machine's speed drifts by more
than the adapter's cost over the seconds between runs one after the other). The median decode step
of each is reported.

    PYTHONPATH=. python benchmarks/lora_batch.py [--model smollm2-135m-instruct] [--repeats 3] [--lora-dtype auto]

Figures: docs/benchmarks.md, "LoRA adapters in a batch"."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from lockstep.configs.model_config import ModelConfig
from lockstep.managers.scheduler import Scheduler, create_scheduler
from lockstep.messages import TokenizedGenerateReq
from lockstep.model_loader import resolve_model
from lockstep.sampling_params import SamplingParams
from lockstep.server_args import ServerArgs
from lockstep.testing.lora_adapters import random_adapter


def run(sched: Scheduler, prompts: list[list[int]], loras: list[str | None], new: int) -> float:
    """Seconds per decode step with every request decoding (the batch at full width)."""
    reqs = [TokenizedGenerateReq(f"r{i}-{time.perf_counter_ns()}", p,
                                 SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True),
                                 lora_path=lora) for i, (p, lora) in enumerate(zip(prompts, loras))]
    steps: list[float] = []
    msgs: list = reqs
    while True:
        t0 = time.perf_counter()
        outs = sched.step(msgs)
        dt = time.perf_counter() - t0
        msgs = []
        if len(outs) == len(prompts) and all(len(o.new_token_ids) == 1 for o in outs) and all(
                r.output_ids for r in sched.running):
            steps.append(dt)
        if sched.is_idle():
            break
    sched.flush_cache()
    return statistics.median(steps)


def run_side_by_side(cases: list[tuple[Scheduler, list[int], str | None]], new: int) -> list[list[float]]:
    """One request per case, each on its own scheduler, stepped in turn: each case's decode steps."""
    for i, (sched, prompt, lora) in enumerate(cases):
        sched.step([TokenizedGenerateReq(f"u{i}-{time.perf_counter_ns()}", prompt,
                                         SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True),
                                         lora_path=lora)])
    steps: list[list[float]] = [[] for _ in cases]
    while not all(sched.is_idle() for sched, *_ in cases):
        for i, (sched, *_) in enumerate(cases):
            if not sched.is_idle():
                t0 = time.perf_counter()
                sched.step([])
                steps[i].append(time.perf_counter() - t0)
    for sched, *_ in cases:
        sched.flush_cache()
    return [s[:-1] for s in steps]  # the last step of each finishes its request


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--user-output-len", type=int, default=256, help="tokens of each one-user run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora-dtype", default="auto", help="the servers' --lora-dtype (auto: int8 slots here)")
    a = p.parse_args()
    cfg = ModelConfig.from_hf(resolve_model(a.model).hf_config)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    names = [f"ad{i}" for i in range(a.adapters)]
    paths = [f"{n}={random_adapter(cfg, tmp / n, seed=i, rank=a.rank)}" for i, n in enumerate(names)]
    common = dict(model_path=a.model, speculative_algorithm="NONE", max_running_requests=a.concurrency,
                  max_total_tokens=a.concurrency * (a.input_len + a.output_len + 8))
    with_lora = dict(lora_paths=paths, max_loras_per_batch=a.adapters, lora_dtype=a.lora_dtype)
    plain, lora = create_scheduler(ServerArgs(**common)), create_scheduler(ServerArgs(**common, **with_lora))
    # the one-user cases on schedulers of their own, alike (none has served the batches)
    one = dict(common, max_running_requests=1, max_total_tokens=a.input_len + a.user_output_len + 8)
    user_plain, user_base, user_adapter = (create_scheduler(ServerArgs(**one)),
                                           *(create_scheduler(ServerArgs(**one, **with_lora)) for _ in range(2)))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, cfg.vocab_size - 100) for _ in range(a.input_len)]
               for _ in range(a.concurrency)]
    spread = [names[i % len(names)] for i in range(a.concurrency)]
    cases = {"batch, plain server, base": (plain, prompts, [None] * a.concurrency),
             "batch, LoRA server, base": (lora, prompts, [None] * a.concurrency),
             f"batch, LoRA server, {a.adapters} adapters": (lora, prompts, spread)}
    users = {"one user, plain server, base": (user_plain, prompts[0], None),
             "one user, LoRA server, base": (user_base, prompts[0], None),
             "one user, LoRA server, adapter": (user_adapter, prompts[0], names[0])}
    for sched, ps, ls in [*cases.values(), *[(s, [p], [lo]) for s, p, lo in users.values()]]:  # warm-up
        run(sched, ps[:2], ls[:2], 4)
    times: dict[str, list[float]] = {k: [] for k in [*cases, *users]}
    for r in range(a.repeats):
        for name, (sched, ps, ls) in cases.items():
            times[name].append(run(sched, ps, ls, a.output_len))
        # each round starts the turn at another case: the place in the turn moved identical
        # schedulers' steps by 2-3% (the first after the others slowest)
        order = [*users][r % len(users):] + [*users][:r % len(users)]
        for name, steps in zip(order, run_side_by_side([users[n] for n in order], a.user_output_len)):
            times[name].append(statistics.median(steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    width = max(map(len, med))
    for k, v in med.items():
        n = a.concurrency if k.startswith("batch") else 1
        print(f"{k:<{width}}  {v * 1e3:8.2f} ms/step  {v / n * 1e3:7.3f} ms/token")
    base, lo = med["batch, LoRA server, base"], med[f"batch, LoRA server, {a.adapters} adapters"]
    print(f"per-token time, {a.adapters} adapters / base: {lo / base:.2f}x "
          f"(/ plain server: {lo / med['batch, plain server, base']:.2f}x)")
    print(f"one user's ITL, adapter / base: {med['one user, LoRA server, adapter'] / med['one user, LoRA server, base']:.2f}x "
          f"(/ plain server: {med['one user, LoRA server, adapter'] / med['one user, plain server, base']:.2f}x)")


if __name__ == "__main__":
    main()

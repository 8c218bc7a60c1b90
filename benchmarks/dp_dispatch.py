"""DP dispatch under skewed request sizes: the same open-loop stream (Poisson arrivals, mostly short
prompts with a long one among them) through `--dp-size 2` with each --load-balance-method, one
server at a time, the methods interleaved over ROUNDS; prints TTFT (median, p90, p99) and end-to-end
latency per method, and appends one JSON line per run to --output-file.

    python benchmarks/dp_dispatch.py [--methods round_robin shortest_queue total_tokens]
        [--requests 60] [--long-every 6] [--long-len 2048] [--short-len 64] [--output-len 8]
        [--rate 1.0] [--rounds 1] [--model-path NAME] [--output-file FILE]

Why it matters: a replica busy prefilling a 2,048-token prompt admits nothing new until that
prefill ends, so a short request sent there waits for it. round_robin ignores load, and
shortest_queue counts requests, so a replica holding one long prompt looks as free as one holding
one short; total_tokens counts the prompt tokens each replica still has to compute (reported by
the replicas, plus what the controller sent since). Requests run through the TokenizerManager of
a launched server (real processes and sockets; no HTTP).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.server_args import ServerArgs


def workload(args: argparse.Namespace) -> list[tuple[float, list[int]]]:
    """(arrival offset in s, prompt ids) per request: the same for every method."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.requests):  # long ones at random places (a fixed period would line
        n = args.long_len if rng.random() < 1 / args.long_every else args.short_len  # up with RR)
        out.append((t, [rng.randrange(100, 20000) for _ in range(n)]))
        t += rng.expovariate(args.rate)
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def drive(tm: Any, load: list[tuple[float, list[int]]], output_len: int) -> list[dict]:
    start = time.perf_counter()

    async def one(at: float, ids: list[int]) -> dict:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        sent = time.perf_counter()
        req = GenerateReqInput(input_ids=ids, sampling_params={
            "max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}).normalize()[0]
        ttft = None
        async for out in tm.generate(req):
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - sent
            last = out
        return {"len": len(ids), "ttft": ttft, "e2e": time.perf_counter() - sent,
                "dp_rank": last.dp_rank}

    return await asyncio.gather(*(one(at, ids) for at, ids in load))


def run(method: str, args: argparse.Namespace, load: list[tuple[float, list[int]]]) -> dict:
    server = ServerArgs(model_path=args.model_path, dp_size=2, load_balance_method=method,
                        max_total_tokens=args.max_total_tokens)
    launched = launch_subprocesses(server)
    try:
        tm = launched.tokenizer_manager

        async def warm_then_drive() -> list[dict]:
            await drive(tm, [(0.0, [100 + i for i in range(16)])] * 2, 2)  # both replicas warm
            return await drive(tm, load, args.output_len)

        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        res = asyncio.run(warm_then_drive())
        wall, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    finally:
        launched.shutdown()
    ttft = [r["ttft"] for r in res]
    short = [r["ttft"] for r in res if r["len"] == args.short_len]
    longs = [r["dp_rank"] for r in res if r["len"] == args.long_len]
    return {"method": method, "requests": len(res), "wall_s": round(wall, 2),
            "ttft_median_s": round(statistics.median(ttft), 3), "ttft_p90_s": round(pct(ttft, 90), 3),
            "ttft_p99_s": round(pct(ttft, 99), 3),
            "short_ttft_p99_s": round(pct(short, 99), 3),
            "e2e_median_s": round(statistics.median(r["e2e"] for r in res), 3),
            "long_prompts_by_replica": [longs.count(0), longs.count(1)],
            "loadavg_before_after": [load0, load1]}  # the machine is shared: how busy it was


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["round_robin", "shortest_queue", "total_tokens"])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--long-every", type=int, default=6,
                   help="one prompt in this many is long, on average")
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", default=None)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--output-file", default=None)
    args = p.parse_args()
    load = workload(args)
    for rnd in range(args.rounds):
        order = args.methods if rnd % 2 == 0 else args.methods[::-1]
        for method in order:
            row = run(method, args, load) | {"round": rnd}
            print(json.dumps(row), flush=True)
            if args.output_file:
                with open(args.output_file, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

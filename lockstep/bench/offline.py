"""Offline throughput: every request of a dataset submitted at once, no HTTP.

    lockstep bench offline --num-prompts 64 --random-input-len 256 --random-output-len 128 \\
        --random-range-ratio 1 --ignore-eos

``--backend engine`` (default) runs ``lockstep.Engine``: the same processes as the server
(tokenizer manager, scheduler, detokenizer), one ``generate`` call with the whole batch.
``--backend inproc`` drives one Scheduler inside this process, no IPC at all: the scheduler
and model alone, which shows what the process plumbing costs. Every server argument
(``--max-running-requests``, ``--chunked-prefill-size``, ``--disable-radix-cache``, ...) applies.
Metrics are SGLang ``bench_offline_throughput``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from typing import Any


def _sampling(row: Any, ignore_eos: bool) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": row.output_len, "ignore_eos": ignore_eos}


def run_engine(server_args: Any, rows: list[Any], ignore_eos: bool, warmup: bool) -> tuple[float, int]:
    import dataclasses

    from lockstep.entrypoints.engine import Engine

    with Engine(**dataclasses.asdict(server_args)) as engine:
        if warmup:
            engine.generate(input_ids=[rows[0].input_ids[: max(2, len(rows[0].input_ids) // 2)]],
                            sampling_params=[{"temperature": 0.0, "max_new_tokens": 4}])
            engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=[r.input_ids for r in rows],
                               sampling_params=[_sampling(r, ignore_eos) for r in rows])
        duration = time.perf_counter() - t0
    outs = outs if isinstance(outs, list) else [outs]
    return duration, sum(o["meta_info"]["completion_tokens"] for o in outs)


def run_inproc(server_args: Any, rows: list[Any], ignore_eos: bool, warmup: bool) -> tuple[float, int]:
    from lockstep.managers.scheduler import create_scheduler
    from lockstep.messages import TokenizedGenerateReq
    from lockstep.sampling_params import SamplingParams

    sched = create_scheduler(server_args)

    def drain(reqs: list[Any]) -> int:
        n = 0
        msgs = reqs
        while True:
            for out in sched.step(msgs):
                n += len(out.new_token_ids)
            msgs = []
            if sched.is_idle():
                return n

    if warmup:
        drain([TokenizedGenerateReq("warmup", rows[0].input_ids[: max(2, len(rows[0].input_ids) // 2)],
                                    SamplingParams(max_new_tokens=4, temperature=0.0))])
        sched.flush_cache()
    reqs = [TokenizedGenerateReq(f"r{i}", list(r.input_ids),
                                 SamplingParams(**_sampling(r, ignore_eos)))
            for i, r in enumerate(rows)]
    t0 = time.perf_counter()
    n = drain(reqs)
    return time.perf_counter() - t0, n


def build_parser() -> argparse.ArgumentParser:
    from lockstep.bench.datasets import add_dataset_args
    from lockstep.server_args import ServerArgs

    p = argparse.ArgumentParser(prog="lockstep bench offline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="engine", choices=["engine", "inproc"])
    add_dataset_args(p)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--skip-warmup", action="store_true")
    p.add_argument("--result-filename", "--output-file", dest="output_file", default=None,
                   help="Append the result as one JSON line.")
    p.add_argument("--tag", default=None)
    server = p.add_argument_group("server arguments")
    ServerArgs.add_cli_args(server)
    return p


def main(argv: list[str] | None = None) -> int:
    from lockstep.bench.datasets import get_dataset, load_tokenizer
    from lockstep.server_args import ServerArgs

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    server_args = ServerArgs.from_cli_args(args)
    tokenizer = load_tokenizer(args.tokenizer or server_args.tokenizer_path or server_args.model_path)
    rows = get_dataset(args, tokenizer)
    run = run_engine if args.backend == "engine" else run_inproc
    duration, total_out = run(server_args, rows, args.ignore_eos, not args.skip_warmup)
    total_in = sum(r.prompt_len for r in rows)
    w = 45
    result = {
        "completed": len(rows), "duration_s": duration, "total_input": total_in,
        "total_output": total_out, "request_throughput": len(rows) / duration,
        "input_throughput": total_in / duration, "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
    }
    print("{s:{c}^{n}}".format(s=" Offline Throughput Benchmark Result ", n=w + 10, c="="))
    print(f"{'Backend:':<{w}}{args.backend:>10}")
    print(f"{'Successful requests:':<{w}}{len(rows):>10}")
    print(f"{'Benchmark duration (s):':<{w}}{duration:>10.2f}")
    print(f"{'Total input tokens:':<{w}}{total_in:>10}")
    print(f"{'Total generated tokens:':<{w}}{total_out:>10}")
    print(f"{'Request throughput (req/s):':<{w}}{result['request_throughput']:>10.2f}")
    print(f"{'Input token throughput (tok/s):':<{w}}{result['input_throughput']:>10.2f}")
    print(f"{'Output token throughput (tok/s):':<{w}}{result['output_throughput']:>10.2f}")
    print(f"{'Total token throughput (tok/s):':<{w}}{result['total_throughput']:>10.2f}")
    print("=" * (w + 10))
    if args.output_file:
        record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "tag": args.tag,
                  "bench": "offline", "backend": args.backend, "dataset_name": args.dataset_name,
                  "num_prompts": len(rows), **result}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One-batch benchmark: prefill and decode latency of a single static batch, no server.

    python -m lockstep.bench.one_batch --batch-size 1 8 32 64 --input-len 256 --output-len 32

The model is built in-process exactly as a scheduler process builds it (``create_scheduler``), and
each batch runs through that Scheduler's own steps: one prefill step for the whole batch (chunked
prefill off), then ``output_len - 1`` decode steps. So the figures include the scheduler's
per-step Python work (batch building, sampling, result processing), not just the forward pass;
the share spent inside the worker (forward + sample) is printed too.

The same prompts then run through HF transformers ``generate`` (greedy, ``min_new_tokens =
max_new_tokens``) at ``--hf-batch-sizes`` (default 1 and 8), in the same process and dtype, and
the ratios are printed. HF's steps are timed inside one ``generate`` call by a logits processor
that notes the time of each step: prefill = start to the first step's logits, decode step = the
median gap between consecutive steps (as lockstep's: the median decode step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from typing import Any

import torch

from lockstep.layers.quantization import QUANTIZATION_METHODS

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Result:
    engine: str  # "lockstep" or "hf"
    batch_size: int
    input_len: int
    output_len: int
    dtype: str
    prefill_s: float
    decode_step_s: float  # median decode step
    total_s: float
    worker_share: float | None = None  # share of step time inside forward + sample (lockstep)
    # median per decode step of step time minus worker time: the scheduler's own Python work
    sched_overhead_s: float | None = None

    @property
    def prefill_tok_s(self) -> float:
        return self.batch_size * self.input_len / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        return self.batch_size / self.decode_step_s

    @property
    def total_tok_s(self) -> float:
        return self.batch_size * (self.input_len + self.output_len) / self.total_s

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(prefill_tok_s=self.prefill_tok_s, decode_tok_s=self.decode_tok_s,
                 total_tok_s=self.total_tok_s)
        return d


def make_prompts(tokenizer: Any, n: int, input_len: int, seed: int) -> list[list[int]]:
    """`n` different corpus prompts of exactly `input_len` tokens (<bos> included)."""
    from lockstep.bench.datasets import sample_random_requests

    rows = sample_random_requests(tokenizer, n, input_len, 1, range_ratio=1.0, seed=seed)
    prompts = []
    for r in rows:
        ids = list(r.input_ids)
        # A decode/re-encode round trip can land a token off; pad or cut to the exact length.
        ids = (ids + ids[1:] * input_len)[:input_len] if len(ids) < input_len else ids[:input_len]
        prompts.append(ids)
    return prompts


class LockstepBench:
    def __init__(self, model_path: str | None, dtype: str, max_bs: int, input_len: int,
                 output_len: int, seed: int, quantization: str | None = None,
                 int8_activations: bool | None = None) -> None:
        from lockstep.managers.scheduler import create_scheduler
        from lockstep.server_args import ServerArgs

        args = ServerArgs(
            model_path=model_path, dtype=dtype, max_running_requests=max_bs,
            max_total_tokens=max_bs * (input_len + output_len) + 256,
            chunked_prefill_size=-1,  # one prefill step for the whole batch
            disable_radix_cache=True,  # every run computes its prompts from scratch
            random_seed=seed,
            # One step = one forward here: the overlap loop would report a step's result a step
            # later, and what this measures is the forward itself.
            enable_overlap_schedule=False,
            quantization=quantization,
            int8_activations=int8_activations,
        )
        self.sched = create_scheduler(args)
        self.dtype = self.sched.worker.runner.dtype
        # The dtype column says what the weights are: q8_0w = q8_0 blocks, float32 compute.
        self.dtype_label = f"{quantization}w" if quantization else _dtype_name(self.dtype)
        if self.sched.worker.runner.weight_plan.target.int8_activations:
            self.dtype_label += "+int8a"  # activations quantized to int8 for the block matmuls
        self.worker_time = 0.0
        worker = self.sched.worker
        inner = worker.forward_batch_generation

        def timed(batch: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(batch)
            finally:
                self.worker_time += time.perf_counter() - t0

        worker.forward_batch_generation = timed
        self.runs = 0

    def run(self, prompts: list[list[int]], output_len: int) -> Result:
        from lockstep.testing.inproc import greedy_req

        sched = self.sched
        self.runs += 1
        reqs = [greedy_req(f"b{self.runs}-{i}", p, output_len) for i, p in enumerate(prompts)]
        got = {r.rid: 0 for r in reqs}
        self.worker_time = 0.0
        t0 = time.perf_counter()
        outs = sched.step(reqs)
        prefill = time.perf_counter() - t0
        if len(sched.running) + sum(o.finish_reason is not None for o in outs) != len(reqs):
            raise RuntimeError(f"the prefill step admitted {len(sched.running)} of {len(reqs)} "
                               "requests; raise the KV budget")
        for o in outs:
            got[o.rid] += len(o.new_token_ids)
        steps, overheads = [], []
        while not sched.is_idle():
            w = self.worker_time
            t = time.perf_counter()
            for o in sched.step():
                got[o.rid] += len(o.new_token_ids)
            steps.append(time.perf_counter() - t)
            overheads.append(steps[-1] - (self.worker_time - w))
        total = time.perf_counter() - t0
        if any(n != output_len for n in got.values()):
            raise RuntimeError(f"expected {output_len} tokens per request, got {sorted(got.values())}")
        sched.check_integrity()
        decode = statistics.median(steps) if steps else float("nan")
        return Result("lockstep", len(prompts), len(prompts[0]), output_len, self.dtype_label,
                      prefill, decode, total, self.worker_time / total,
                      statistics.median(overheads) if overheads else None)


class HFBench:
    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from lockstep.testing.hf_weights import hf_float_model

        # A GGUF's cache entry holds no float weights: HF runs on its blocks dequantized.
        self.model = hf_float_model(model_dir, dtype, attn_implementation="sdpa")
        self.dtype = dtype

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], output_len: int) -> Result:
        from transformers import LogitsProcessor, LogitsProcessorList

        class Clock(LogitsProcessor):
            """Called once per generated token, right after that step's forward pass."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.times.append(time.perf_counter())
                return scores

        ids = torch.tensor(prompts, dtype=torch.int64)
        clock = Clock()
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                  min_new_tokens=output_len, do_sample=False, top_k=None, top_p=None,
                                  temperature=None, pad_token_id=0,
                                  logits_processor=LogitsProcessorList([clock]))
        total = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + output_len and len(clock.times) == output_len
        steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
        decode = statistics.median(steps) if steps else float("nan")
        return Result("hf", len(prompts), len(prompts[0]), output_len, _dtype_name(self.dtype),
                      clock.times[0] - t0, decode, total)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def format_table(results: list[Result]) -> str:
    head = (f"{'engine':<9}{'dtype':<9}{'batch':>6}{'in':>6}{'out':>5}{'prefill ms':>12}"
            f"{'prefill tok/s':>15}{'decode ms/step':>16}{'decode tok/s':>14}"
            f"{'total s':>9}{'total tok/s':>13}{'sched ms/step':>15}")
    lines = [head, "-" * len(head)]
    for r in results:
        share = f"{1000 * r.sched_overhead_s:.2f}" if r.sched_overhead_s is not None else "-"
        lines.append(f"{r.engine:<9}{r.dtype:<9}{r.batch_size:>6}{r.input_len:>6}{r.output_len:>5}"
                     f"{1000 * r.prefill_s:>12.1f}{r.prefill_tok_s:>15.1f}"
                     f"{1000 * r.decode_step_s:>16.1f}{r.decode_tok_s:>14.1f}"
                     f"{r.total_s:>9.2f}{r.total_tok_s:>13.1f}{share:>15}")
    return "\n".join(lines)


def format_ratios(results: list[Result]) -> str:
    ours = {r.batch_size: r for r in results if r.engine == "lockstep"}
    lines = []
    for h in (r for r in results if r.engine == "hf"):
        o = ours.get(h.batch_size)
        if o is None:
            continue
        lines.append(f"batch {h.batch_size:>3}: lockstep/HF  prefill tok/s x{o.prefill_tok_s / h.prefill_tok_s:.2f}"
                     f"  decode tok/s x{o.decode_tok_s / h.decode_tok_s:.2f}"
                     f"  end-to-end x{h.total_s / o.total_s:.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep bench one_batch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="GGUF file, HF dir or packaged model (default: the default model).")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[1, 8],
                   help="Batch sizes to run through HF transformers generate (none: skip HF).")
    p.add_argument("--hf-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype for HF transformers (default: --dtype).")
    p.add_argument("--no-hf", action="store_true", help="Skip HF transformers.")
    p.add_argument("--warmup", type=int, default=1, help="Warm-up runs (batch 1, 4 tokens).")
    p.add_argument("--repeat", type=int, default=1, help="Runs per batch size; the best is kept.")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="lockstep's --quantization (HF runs its own dtype regardless).")
    p.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="lockstep's --int8-activations (default: the server's, on where it "
                        "applies; HF runs its own dtype regardless).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's).")
    p.add_argument("--result-file", default=None, help="Append one JSON line per result.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from lockstep.bench.datasets import load_tokenizer
    from lockstep.model_loader import resolve_model

    source = resolve_model(args.model_path)
    tokenizer = load_tokenizer(str(source.model_dir))
    max_bs = max(args.batch_size + (args.hf_batch_sizes or [1]))
    prompts = make_prompts(tokenizer, max_bs, args.input_len, args.seed)
    t = time.perf_counter()
    bench = LockstepBench(args.model_path, args.dtype, max(args.batch_size), args.input_len,
                          args.output_len, args.seed, args.quantization, args.int8_activations)
    print(f"lockstep model built in {time.perf_counter() - t:.1f} s, dtype {bench.dtype}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    for _ in range(args.warmup):
        bench.run(prompts[:1], min(4, args.output_len))
    results: list[Result] = []

    def best(runner: Any, bs: int) -> Result:
        runs = [runner.run(prompts[:bs], args.output_len) for _ in range(max(1, args.repeat))]
        return min(runs, key=lambda r: r.total_s)

    for bs in args.batch_size:
        r = best(bench, bs)
        results.append(r)
        print(format_table([r]).splitlines()[-1], flush=True)
    hf_sizes = [] if args.no_hf else (args.hf_batch_sizes or [])
    if hf_sizes:
        del bench
        hf = HFBench(str(source.model_dir), _resolve_dtype(args.hf_dtype or args.dtype))
        hf.run(prompts[:1], min(4, args.output_len))  # warm-up
        for bs in hf_sizes:
            r = best(hf, bs)
            results.append(r)
            print(format_table([r]).splitlines()[-1], flush=True)
    print()
    print(format_table(results))
    ratios = format_ratios(results)
    if ratios:
        print()
        print(ratios)
    if args.result_file:
        with open(args.result_file, "a") as f:
            for r in results:
                f.write(json.dumps({"bench": "one_batch", **r.as_dict()}) + "\n")
    return 0


def _resolve_dtype(name: str) -> torch.dtype:
    from lockstep.model_executor.model_runner import resolve_dtype

    return resolve_dtype(name, "cpu")


if __name__ == "__main__":
    sys.exit(main())

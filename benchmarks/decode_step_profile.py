"""Where a decode step goes: torch-profiler self CPU time per step by op group, and the step's
unprofiled wall time. Default model and flags, in-process scheduler: with speculation on (a CPU's
default), a step at batch 4 or less is a verify pass of up to 16 rows, so the requests ask for 16
tokens per step they take part in.

    python benchmarks/decode_step_profile.py BATCH
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from torch.profiler import profile, record_function

from lockstep import kernels
from lockstep.bench.datasets import load_tokenizer
from lockstep.bench.one_batch import LockstepBench, make_prompts
from lockstep.layers import attention, sampler
from lockstep.model_loader import resolve_model
from lockstep.testing.inproc import greedy_req

STEPS = 8
GROUPS = {
    # The compiled kernels are not torch ops: main() labels their calls for the profiler.
    "linears": ["lockstep::linear", "aten::addmm", "aten::linear"],
    "fused norms, rotary, activation": ["lockstep::fused"],
    "embedding rows": ["lockstep::embedding"],
    "KV gather": ["aten::index", "aten::index_select"],
    "attention math": ["aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm",
                       "aten::mm", "aten::_softmax", "aten::masked_fill_", "aten::masked_fill"],
    "decode attention kernel": ["lockstep::decode_attention"],
    "argmax": ["aten::argmax", "aten::max", "lockstep::argmax"],
    # a whole layer in one compiled call (the default on a CPU): its linears and attention inside
    "one-call decoder layers": ["lockstep::decoder_layer"],
}


def _labelled(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        with record_function(name):
            return fn(*args)
    return call


def label_kernels() -> None:
    """Name the compiled kernels' calls for the profiler (GROUPS' lockstep:: entries)."""
    kernels.linear = _labelled(kernels.linear, "lockstep::linear")
    kernels.linear_parts = _labelled(kernels.linear_parts, "lockstep::linear")
    kernels.linear_int8 = _labelled(kernels.linear_int8, "lockstep::linear")
    kernels.linear_int8_parts = _labelled(kernels.linear_int8_parts, "lockstep::linear")
    for name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "act_and_mul"):
        setattr(kernels, name, _labelled(getattr(kernels, name), "lockstep::fused"))
    kernels.embedding = _labelled(kernels.embedding, "lockstep::embedding")
    attention.decode_attention = _labelled(attention.decode_attention, "lockstep::decode_attention")
    sampler.argmax = _labelled(sampler.argmax, "lockstep::argmax")
    kernels.decoder_layer = _labelled(kernels.decoder_layer, "lockstep::decoder_layer")


def group_ms(prof: Any, runs: int) -> tuple[dict[str, float], float]:
    """Self CPU ms per run of each group of GROUPS (and "other ops"), and of all ops."""
    per_run = {k: 0.0 for k in GROUPS}
    total = 0.0
    for e in prof.key_averages():
        total += e.self_cpu_time_total
        for k, names in GROUPS.items():
            if e.key in names:
                per_run[k] += e.self_cpu_time_total
    ms = {k: v / runs / 1000 for k, v in per_run.items()}
    ms["other ops"] = (total - sum(per_run.values())) / runs / 1000
    return ms, total / runs / 1000


def main() -> None:
    batch = int(sys.argv[1])
    label_kernels()
    tok = load_tokenizer(str(resolve_model(None).model_dir))
    prompts = make_prompts(tok, batch, 256, 0)
    bench = LockstepBench(None, "auto", batch, 256, 16, 0)
    bench.run(prompts[:1], 4)  # warm-up
    sched = bench.sched

    def start(tag: str) -> None:  # prefill, then two decode steps before measuring
        sched.step([greedy_req(f"{tag}{i}", p, 16 * (4 + STEPS)) for i, p in enumerate(prompts)])
        sched.step()
        sched.step()

    def finish() -> None:
        while not sched.is_idle():
            sched.step()

    start("x")
    t = time.perf_counter()
    for _ in range(STEPS):
        sched.step()
    wall = (time.perf_counter() - t) / STEPS * 1e3
    finish()
    start("y")
    with profile() as prof:
        for _ in range(STEPS):
            sched.step()
    finish()
    ms, total = group_ms(prof, STEPS)
    print(f"batch {batch}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
          + f"; all ops {total:.1f} ms; wall {wall:.1f} ms/step (unprofiled)")


if __name__ == "__main__":
    main()

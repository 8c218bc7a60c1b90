"""A/B of the decode-step changes of 2026-11-30 against the implementations they replaced, in one
process: the same decode switches between the two every 2 steps, so both see the same load.

    python benchmarks/decode_step_ab.py BATCH STEPS [gather|mm|argmax|norm]

With a component named, only that one is switched (the others stay new). Prints the median step
time of each variant. Default model and flags, in-process scheduler.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.bench.datasets import load_tokenizer
from lockstep.bench.one_batch import LockstepBench, make_prompts
from lockstep.layers import attention, norm, sampler
from lockstep.model_loader import resolve_model
from lockstep.testing.inproc import greedy_req

NEW: dict[str, Any] = {
    "gather": attention.PagedAttention.__dict__["_gather"],
    "mm": attention.PagedAttention._matmul_attention,
    "one": attention.PagedAttention._one_query,  # a CPU decode step's per-request attention
    "argmax": sampler._argmax,
    "norm": norm.RMSNorm.forward,
}


def old_gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return buffer[slots].transpose(1, 2)  # advanced indexing


def old_mm(self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if self.softcap is not None:
        return NEW["mm"](self, q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                          enable_gqa=self.n_heads != self.n_kv_heads)


def old_one(self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, scale=self.scaling,
                                          enable_gqa=self.n_heads != self.n_kv_heads)


def old_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    if self.gemma:
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
    return self.weight * xf.to(x.dtype)


OLD: dict[str, Any] = {"gather": staticmethod(old_gather), "mm": old_mm, "one": old_one,
                       "argmax": lambda x: x.argmax(-1), "norm": old_norm}


def use(impl: dict[str, Any]) -> None:
    attention.PagedAttention._gather = impl["gather"]
    attention.PagedAttention._matmul_attention = impl["mm"]
    attention.PagedAttention._one_query = impl["one"]
    sampler._argmax = impl["argmax"]
    norm.RMSNorm.forward = impl["norm"]


def main() -> None:
    batch, steps = int(sys.argv[1]), int(sys.argv[2])
    only = sys.argv[3] if len(sys.argv) > 3 else None
    # "mm" names the attention math: the batched path's and a CPU decode's per-request one.
    old = {k: (OLD[k] if only in (None, k) or (only, k) == ("mm", "one") else NEW[k]) for k in NEW}
    tok = load_tokenizer(str(resolve_model(None).model_dir))
    prompts = make_prompts(tok, batch, 256, 0)
    bench = LockstepBench(None, "auto", batch, 256 + steps, 16, 0)
    bench.run(prompts[:1], 4)  # warm-up
    sched = bench.sched
    sched.step([greedy_req(f"x{i}", p, steps + 4) for i, p in enumerate(prompts)])
    sched.step()
    times: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(steps):
        name = "old" if (i // 2) % 2 == 0 else "new"
        use(old if name == "old" else NEW)
        t = time.perf_counter()
        sched.step()
        times[name].append(time.perf_counter() - t)
    o, n = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
    print(f"[{only or 'all'}] batch {batch}: median decode step old {o:.1f} ms, new {n:.1f} ms, "
          f"new/old {n / o:.3f} ({len(times['old'])}+{len(times['new'])} steps)")


if __name__ == "__main__":
    main()

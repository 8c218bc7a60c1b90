"""Decode attention and greedy argmax: the torch path they replaced against the compiled kernels, on
Gemma 3 270M's shapes (4 query heads on 1 KV head of 256), one thread, CPU time of this thread (the
machine is shared; thread time hides the others' load better than wall time). Best of several rounds.

    python benchmarks/decode_kernels_bench.py          # K/V and logits hot in cache between calls
    python benchmarks/decode_kernels_bench.py --cold   # 384 MB streamed before each call, as a
                                                       # decode step's weights evict the KV pool
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from lockstep.kernels import argmax, decode_attention, kernel_variant

H, HKV, D = 4, 1, 256
SCALING = D**-0.5


def torch_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, flat: torch.Tensor,
                    lens: list[int]) -> torch.Tensor:
    """The CPU decode path before the kernel: one gather of the batch's keys, then per request."""
    keys_all, vals_all = k_buf.index_select(0, flat), v_buf.index_select(0, flat)
    outs, k0 = [], 0
    for r, n in enumerate(lens):
        keys = keys_all[k0:k0 + n].unsqueeze(0).transpose(1, 2)
        vals = vals_all[k0:k0 + n].unsqueeze(0).transpose(1, 2)
        scores = torch.matmul(q[r].reshape(1, HKV, H // HKV, D), keys.transpose(-1, -2)).mul_(SCALING)
        outs.append(torch.matmul(scores.softmax(-1), vals).reshape(1, H * D))
        k0 += n
    return torch.cat(outs)


def pool_slots(batch: int, length: int, prompt: int = 256) -> torch.Tensor:
    """Slots as a real pool lays them out: each prompt contiguous, decode tokens interleaved by step."""
    pre = min(length, prompt)
    flat: list[int] = []
    for r in range(batch):
        flat += range(1 + r * pre, 1 + (r + 1) * pre)
        flat += [1 + batch * pre + t * batch + r for t in range(length - pre)]
    return torch.tensor(flat)


def cpu_ms(fn: Callable[[], object], evict: torch.Tensor | None) -> float:
    for _ in range(3):
        fn()
    calls, rounds = (1, 15) if evict is not None else (20, 7)
    best = float("inf")
    for _ in range(rounds):
        if evict is not None:
            evict.add_(1.0)
        t = time.thread_time_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time_ns() - t) / calls / 1e6)
    return best


def attention_row(batch: int, length: int, evict: torch.Tensor | None) -> str:
    flat = pool_slots(batch, length)
    g = torch.Generator().manual_seed(0)
    k_buf = torch.randn(int(flat.max()) + 1, HKV, D, generator=g)
    v_buf = torch.randn_like(k_buf)
    q = torch.randn(batch, H, D, generator=g)
    lens = torch.full((batch,), length, dtype=torch.int64)
    starts = torch.arange(batch) * length
    old = cpu_ms(partial(torch_attention, q, k_buf, v_buf, flat, [length] * batch), evict)
    new = cpu_ms(partial(decode_attention, q, k_buf, v_buf, flat, starts, lens, SCALING, None, None), evict)
    return f"| attention, one layer, batch {batch}, {length} keys | {old:.3f} ms | {new:.3f} ms | {old / new:.1f}x |"


def argmax_row(batch: int, evict: torch.Tensor | None) -> str:
    x = torch.randn(batch, 262144)
    old = cpu_ms(lambda: x.max(dim=-1).indices, evict)
    new = cpu_ms(partial(argmax, x), evict)
    return f"| argmax [{batch}, 262144] | {old:.3f} ms | {new:.3f} ms | {old / new:.1f}x |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="evict the caches before each call")
    args = ap.parse_args()
    torch.set_num_threads(1)
    evict = torch.ones(96 * 2**20) if args.cold else None
    print(f"kernel variant: {kernel_variant()}; {'cold' if args.cold else 'hot'} caches; 1 thread")
    print("| | torch path | compiled | speed-up |\n|---|---|---|---|")
    for batch, length in [(1, 144), (1, 270), (32, 144), (32, 270), (1, 4096)]:
        print(attention_row(batch, length, evict))
    for batch in (1, 32):
        print(argmax_row(batch, evict))

if __name__ == "__main__":
    main()

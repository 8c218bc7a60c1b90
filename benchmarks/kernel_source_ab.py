"""Two or more versions of one kernel source, built side by side and timed in turn in one process.

    T=1 python benchmarks/kernel_source_ab.py int8 avx512 --rows 256 A.cpp B.cpp
    python benchmarks/kernel_source_ab.py attention avx2 A.cpp B.cpp

Each source is a version of csrc/int8.cpp or csrc/attention.cpp (e.g. `git show REV:lockstep/kernels/csrc/
int8.cpp > /tmp/a.cpp`); `A.cpp:A.h` builds A.cpp beside its own blocks.h. Each is compiled alone with
the variant's flags into its own extension, so one process holds them all, and every round runs each
once, in turn: a drifting host (docs/benchmarks.md) falls on all of them alike. The first is the
baseline: each line gives the others' minimum time over it, and whether their outputs are the same bits.
  int8: linear_int8 on the default GGUF's matrices (as served: the unpacked int8 layouts), `--rows` rows; the
  262k-row head only at decode batches (64 rows or fewer).
  attention: decode_attention on one 2,048-row prefill (4 query heads of 256, one KV head), causal and
  windowed (512).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kernel_bench import gguf_cases
from torch.utils.cpp_extension import load

from lockstep.kernels import unpack_for_int8
from lockstep.kernels.build import CFLAGS, CSRC
from lockstep.utils.process import keep_freed_memory

BINDINGS = {  # op -> (source file name, the function it exports)
    "int8": ("int8.cpp", "linear_int8"),
    "attention": ("attention.cpp", "decode_attention"),
}


def build(op: str, variant: str, spec: str, root: Path):
    src, _, header = spec.partition(":")
    name, fn = BINDINGS[op]
    digest = hashlib.sha1(Path(src).read_bytes() + variant.encode() + (Path(header).read_bytes() if header else b""))
    d = root / digest.hexdigest()[:12]
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, d / name)
    if header:  # found before CSRC's: "blocks.h" is included with quotes
        shutil.copy(header, d / "blocks.h")
    (d / "bind.cpp").write_text(
        '#include <torch/csrc/utils/pybind.h>\n#include "ops.h"\n'
        f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def(\"{fn}\", &lockstep::{fn}); }}\n")
    mod = load(name=f"ab_{op}_{d.name}", sources=[str(d / name), str(d / "bind.cpp")], extra_cflags=CFLAGS[variant],
               extra_include_paths=[str(CSRC)], build_directory=str(d))
    return getattr(mod, fn)


def cases(op: str, rows: int) -> list[tuple[str, Callable]]:
    torch.manual_seed(0)
    if op == "int8":
        out = []
        for label, stored, stored_type, k in gguf_cases():
            if stored.shape[0] > 65536 and rows > 64:  # the head: minutes per round at hundreds of rows
                continue
            qtype, blocks = unpack_for_int8(stored_type, stored, k)
            x = torch.randn(rows, k)
            out.append((f"{label.split()[0]} {qtype}", lambda f, x=x, b=blocks, q=qtype, k=k: f(x, b, q.code, k)))
        return out
    n, heads, dim = 2048, 4, 256
    q = torch.randn(n, heads, dim)
    k, v = torch.randn(n, 1, dim), torch.randn(n, 1, dim)
    slots = torch.arange(n, dtype=torch.long)
    starts, lens = torch.zeros(n, dtype=torch.long), torch.arange(1, n + 1, dtype=torch.long)
    return [(f"{n}-row prefill, window {w or 'none'}",
             lambda f, w=w: f(q, k, v, slots, starts, lens, dim ** -0.5, 0.0, w)) for w in (0, 512)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", choices=sorted(BINDINGS))
    p.add_argument("variant", choices=sorted(CFLAGS))
    p.add_argument("sources", nargs="+", help="SRC.cpp or SRC.cpp:blocks.h; the first is the baseline")
    p.add_argument("--rows", type=int, default=256, help="int8: rows of x")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("T", torch.get_num_threads())))
    keep_freed_memory()  # as a serving process: big outputs reuse memory, not fresh pages per call
    root = Path(tempfile.gettempdir()) / "lockstep-kernel-ab"
    fns = [build(args.op, args.variant, s, root) for s in args.sources]
    names = [Path(s.partition(":")[0]).stem for s in args.sources]
    for label, call in cases(args.op, args.rows):
        ref = call(fns[0])
        same = [torch.equal(ref, call(f)) for f in fns]
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(args.reps):
            for i, f in enumerate(fns):
                t = time.perf_counter()
                call(f)
                times[i].append(time.perf_counter() - t)
        base = min(times[0])
        print(f"{label:34s} " + "  ".join(
            f"{names[i]} {min(t) * 1e3:.2f} ms ({min(t) / base:.3f}{'' if same[i] else ', other bits'})"
            for i, t in enumerate(times)), flush=True)


if __name__ == "__main__":
    main()

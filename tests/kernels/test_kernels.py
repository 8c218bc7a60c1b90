"""lockstep.kernels: the torch reference against gguf.quants, and every compiled variant against the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lockstep.kernels import dequantize, quantize, row_bytes
from lockstep.kernels.build import VARIANTS
from lockstep.testing.kernels import (
    assert_batch_invariant,
    compiled,
    random_blocks,
    variant_params,
)

QTYPES = ["F32", "F16", "BF16", "Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]


def gguf_dequantize(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType[qtype]
    raw = blocks.numpy()
    if qtype == "F32":
        return torch.from_numpy(raw.view(np.float32).copy())
    if qtype == "F16":
        return torch.from_numpy(raw.view(np.float16).astype(np.float32))
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf_on_random_blocks(qtype: str) -> None:
    blocks = random_blocks(qtype, 48, 512, seed=1)
    ours = dequantize(qtype, blocks, 512)
    assert ours.dtype == torch.float32 and ours.shape == (48, 512)
    assert torch.equal(ours, gguf_dequantize(qtype, blocks))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q4_0", "Q5_0", "Q8_0"])
def test_quantize_matches_gguf_bytes(qtype: str) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 256, generator=g) * torch.rand(40, 1, generator=g)
    w[3] = 0.0  # an all-zero block: scale 0, no division by zero
    w[5, :32] = torch.tensor([0.5, -0.5] * 16)  # ties in |max|: the first one decides the sign
    ours = quantize(qtype, w)
    assert ours.dtype == torch.uint8 and ours.shape == (40, row_bytes(qtype, 256))
    if qtype == "F32":
        expect = w.numpy().view(np.uint8)
    elif qtype == "F16":
        expect = w.numpy().astype(np.float16).view(np.uint8)
    else:
        expect = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(ours.numpy(), expect.reshape(40, -1))
    # and it round-trips through our own dequantize close to the input
    back = dequantize(qtype, ours, 256)
    tol = {"Q4_0": 0.2, "Q5_0": 0.1, "Q8_0": 0.02}.get(qtype, 0.01)
    assert (back - w).abs().max() <= tol * w.abs().max()


def test_row_bytes_and_shape_errors() -> None:
    assert row_bytes("Q8_0", 640) == 680 and row_bytes("Q4_K", 2048) == 1152 and row_bytes("F16", 3) == 6
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes("Q6_K", 640)
    with pytest.raises(ValueError, match="unsupported GGML block type"):
        row_bytes("IQ2_XXS", 256)
    with pytest.raises(ValueError, match=r"uint8 \[N, 680\]"):
        dequantize("Q8_0", torch.zeros(2, 672, dtype=torch.uint8), 640)
    with pytest.raises(ValueError, match="no quantizer"):
        quantize("Q4_K", torch.zeros(1, 256))


def gguf_tensors_by_type(reader) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in reader.tensors:
        out.setdefault(t.tensor_type.name, []).append(t)
    return out


@pytest.mark.parametrize("qtype", ["Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_dequantize_matches_gguf_on_gemma(qtype: str, gemma_gguf) -> None:
    tensors = gguf_tensors_by_type(gemma_gguf)[qtype]
    for t in (tensors[0], tensors[-1]):
        rows = torch.from_numpy(np.array(t.data[:96]))
        n_cols = int(t.shape[0])
        assert rows.shape[1] == row_bytes(qtype, n_cols)
        assert torch.equal(dequantize(qtype, rows, n_cols), gguf_dequantize(qtype, rows)), t.name


def test_torch_linear_and_embedding_are_the_reference() -> None:
    from lockstep.kernels import embedding, linear

    blocks = random_blocks("Q8_0", 24, 96, seed=3)
    x = torch.randn(5, 96)
    w = dequantize("Q8_0", blocks, 96)
    torch.testing.assert_close(linear(x, blocks, "Q8_0", 96), x @ w.T)
    ids = torch.tensor([3, 0, 23, 3])
    assert torch.equal(embedding(ids, blocks, "Q8_0", 96), w[ids])
    with pytest.raises(ValueError, match=r"float32 x \[M, 96\]"):
        linear(x.double(), blocks, "Q8_0", 96)


# ---------------------------------------------------------------- compiled variants

def reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    return (x.double() @ dequantize(qtype, blocks, k).double().T).float()


def assert_close_to_reference(y: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    # float32 sums of k products against float64: a few ulps of the magnitudes involved
    assert y.shape == ref.shape and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6 * k**0.5 * max(1.0, ref.abs().max().item()))


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("qtype", [*QTYPES, "Q5_0_U8", "Q4_K_S8", "Q6_K_U8"])  # and ours: unpacked at load
def test_linear_matches_reference_and_is_batch_invariant(variant: str, qtype: str) -> None:
    mod = compiled(variant)
    k = 512
    g = torch.Generator().manual_seed(6)
    for n in (1, 37):  # one row; rows not a multiple of any tile
        blocks = random_blocks(qtype, n, k, seed=n)
        x = torch.randn(64, k, generator=g)
        for m in (1, 2, 3, 4, 7, 32, 64):
            xm = x[:m].contiguous()
            y = mod.linear(xm, blocks, qtype, k)
            assert_close_to_reference(y, reference(xm, blocks, qtype, k), k)
            assert torch.equal(y[:1], mod.linear(x[:1].contiguous(), blocks, qtype, k))
        assert_batch_invariant(lambda a, b=blocks: mod.linear(a.contiguous(), b, qtype, k), x[:32])
    ids = torch.tensor([36, 0, 5, 36])
    assert torch.equal(mod.embedding(ids, blocks, qtype, k), dequantize(qtype, blocks, k)[ids])


@pytest.mark.parametrize("variant", variant_params())
def test_strided_rows_of_whole_blocks(variant: str) -> None:
    """A row-parallel shard is a column slice of whole blocks: served without a copy, same numbers."""
    blocks = random_blocks("Q4_K", 19, 1024, seed=7)
    shard = blocks[:, 144 * 2 : 144 * 4]  # input elements 512..1023
    assert not shard.is_contiguous()
    x = torch.randn(3, 512)
    y = compiled(variant).linear(x, shard, "Q4_K", 512)
    assert torch.equal(y, compiled(variant).linear(x, shard.contiguous(), "Q4_K", 512))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_compiles_on_this_machine(variant: str, tmp_path) -> None:
    """A variant this CPU runs is built and loaded; one it cannot run is still compiled (syntax and
    templates, without linking): a change tried on an AVX2 machine must not break the AVX-512 build
    unseen, nor the reverse."""
    from lockstep.kernels.build import missing_flags
    from lockstep.testing.kernels import compile_errors

    if missing_flags(variant):
        errors = compile_errors(variant, tmp_path)
        assert not errors, errors[-3000:]
    else:
        assert compiled(variant).linear_int8 is not None


def test_variants_agree_bitwise() -> None:
    """The AVX2 and AVX-512 builds sum in the same lane order: identical outputs, not just close ones."""
    from lockstep.kernels.build import missing_flags

    if missing_flags("avx512"):
        pytest.skip(f"this CPU lacks {', '.join(missing_flags('avx512'))} for avx512")
    x = torch.randn(5, 768)
    for qtype in ("Q8_0", "Q5_0", "Q4_K", "Q6_K", "F16"):
        blocks = random_blocks(qtype, 21, 768, seed=8)
        for m in (1, 5):  # the streaming gemv and the panel gemm decode blocks each their own way
            ys = [compiled(v).linear(x[:m].contiguous(), blocks, qtype, 768) for v in ("avx2", "avx512")]
            assert torch.equal(*ys), (qtype, m)


@pytest.mark.parametrize("variant", variant_params())
def test_gemma_gguf_head_262k(variant: str, gemma_gguf) -> None:
    """The tied 262144 x 640 Q8_0 head of Gemma 3 270M, at batch 1 and as a row of a batch."""
    t = next(t for t in gemma_gguf.tensors if t.name == "token_embd.weight")
    head = torch.from_numpy(np.array(t.data))
    mod = compiled(variant)
    x = torch.randn(3, 640)
    y1 = mod.linear(x[1:2].contiguous(), head, "Q8_0", 640)
    assert y1.shape == (1, 262144)
    assert torch.equal(mod.linear(x, head, "Q8_0", 640)[1], y1[0])
    assert_close_to_reference(y1, reference(x[1:2], head, "Q8_0", 640), 640)


SELECT_PROBE = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from lockstep.kernels import compiled, kernel_variant, linear, dequantize, quantize
w = quantize("Q8_0", torch.randn(8, 64))
x = torch.randn(2, 64)
assert torch.allclose(linear(x, w, "Q8_0", 64), x @ dequantize("Q8_0", w, 64).T, atol=1e-5)
print("RESULT", kernel_variant(), compiled("linear"))
"""


def run_probe(env: dict[str, str]) -> tuple[str, str]:
    import os
    import subprocess
    import sys

    full = {**os.environ, **env}
    proc = subprocess.run([sys.executable, "-c", SELECT_PROBE], env=full, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return result, proc.stderr


def test_forced_torch_serves_the_reference() -> None:
    result, log = run_probe({"LOCKSTEP_KERNEL_ISA": "torch"})
    assert result == "RESULT torch False"
    assert "serving on the torch reference (LOCKSTEP_KERNEL_ISA=torch)" in log


def test_no_compiler_serves_torch_and_says_why_once(tmp_path) -> None:
    from lockstep.kernels.build import missing_flags

    if missing_flags("avx2"):
        pytest.skip(f"this CPU lacks {', '.join(missing_flags('avx2'))}: nothing would be compiled")
    # an empty kernel cache and a compiler that does not exist
    result, log = run_probe({"LOCKSTEP_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-c++"),
                             "LOCKSTEP_KERNEL_ISA": "avx2"})
    assert result == "RESULT torch False"
    assert log.count("lockstep CPU kernels unavailable, serving on the torch reference") == 1, log


def test_automatic_selection_picks_the_best_variant_the_cpu_runs() -> None:
    from lockstep.kernels.build import missing_flags

    expect = next((v for v in ("avx512", "avx2") if not missing_flags(v)), "torch")
    result, log = run_probe({"LOCKSTEP_KERNEL_ISA": ""})
    assert result == f"RESULT {expect} {expect != 'torch'}"
    assert f"lockstep CPU kernels: {expect} variant" in log or expect == "torch"


FAKE_BUILD = """
import os, sys, time, types
from lockstep.kernels import build
calls = os.path.join(os.environ["LOCKSTEP_CACHE_DIR"], "calls")

def fake_compile(variant, name, build_dir):
    with open(calls, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(float(sys.argv[1]))
    return types.ModuleType(name)

build._compile = fake_compile
build._import_built = lambda name, so: types.ModuleType(name)
build.load_variant("avx2")
print("loaded")
"""


def test_concurrent_builds_compile_once_and_a_killed_build_does_not_wedge(tmp_path) -> None:
    """Two processes (TP ranks) starting on an empty cache build once, under a lock the OS releases if
    the builder dies. The compiler is replaced by a sleep: this tests the locking, not the compiler."""
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "LOCKSTEP_CACHE_DIR": str(tmp_path)}
    calls = tmp_path / "calls"

    def start(seconds: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", FAKE_BUILD, str(seconds)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # a builder killed mid-build: the next one takes the lock and builds
    doomed = start(60)
    deadline = time.monotonic() + 60
    while not calls.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    doomed.kill()
    doomed.wait()
    calls.unlink()
    # two at once: one builds, the other waits for it and loads its result
    procs = [start(1.0), start(1.0)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 and out.strip() == "loaded" for p, (out, _) in zip(procs, outs)), outs
    assert len(calls.read_text().split()) == 1


def test_amx_bf16_path_matches_its_reference_and_is_batch_invariant() -> None:
    """The opt-in bfloat16 path: bf16(x) @ bf16(W).T in float32, a row the same alone or in a batch."""
    from lockstep.kernels.build import missing_flags

    lacking = missing_flags("amx_bf16")
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(lacking)} for the AMX bfloat16 path")
    mod = compiled("avx512")
    k = 512
    g = torch.Generator().manual_seed(9)
    for qtype in QTYPES:
        for n in (1, 37):
            blocks = random_blocks(qtype, n, k, seed=n + 1)
            w = dequantize(qtype, blocks, k).bfloat16().double()
            x = torch.randn(40, k, generator=g)

            def run(a, b=blocks, q=qtype):
                return mod.linear_amx_bf16(a.bfloat16().contiguous(), b, q, k)

            for m in (1, 7, 40):
                y = run(x[:m])
                ref = (x[:m].bfloat16().double() @ w.T).float()
                assert_close_to_reference(y, ref, k)
            assert_batch_invariant(run, x[:33])


def test_linear_bf16_api_serves_compiled_where_it_can() -> None:
    from lockstep.kernels import compiled, kernel_variant, linear_bf16
    from lockstep.kernels.build import missing_flags

    blocks = random_blocks("Q8_0", 20, 256, seed=10)
    x = torch.randn(6, 256)
    y = linear_bf16(x, blocks, "Q8_0", 256)
    ref = (x.bfloat16().double() @ dequantize("Q8_0", blocks, 256).bfloat16().double().T).float()
    assert_close_to_reference(y, ref, 256)
    expect = kernel_variant() == "avx512" and not missing_flags("amx_bf16")
    assert compiled("linear_bf16") == expect


def test_public_api_on_rows_the_kernels_do_not_take() -> None:
    """Float rows that are not whole 32-element groups go to the reference, with the same answers."""
    from lockstep.kernels import embedding, linear

    blocks = random_blocks("F16", 9, 40, seed=11)
    x = torch.randn(3, 40)
    assert_close_to_reference(linear(x, blocks, "F16", 40), reference(x, blocks, "F16", 40), 40)
    ids = torch.tensor([[1, 8, 0], [2, 2, 5]])
    assert torch.equal(embedding(ids, blocks, "F16", 40), dequantize("F16", blocks, 40)[ids])
    q8 = random_blocks("Q8_0", 9, 64, seed=12)
    assert embedding(ids, q8, "Q8_0", 64).shape == (2, 3, 64)


def test_a_damaged_build_serves_torch_then_rebuilds(tmp_path) -> None:
    """A cached .so that will not load: the torch path serves, and the next start compiles afresh."""
    from lockstep.kernels.build import _build_dir, missing_flags

    if missing_flags("avx2"):
        pytest.skip(f"this CPU lacks {', '.join(missing_flags('avx2'))}: nothing would be compiled")
    name, where = _build_dir("avx2")
    build_dir = tmp_path / "kernels" / where.name
    build_dir.mkdir(parents=True)
    (build_dir / f"{name}.so").write_bytes(b"not an ELF file")
    (build_dir / "built").write_text("x")
    env = {"LOCKSTEP_CACHE_DIR": str(tmp_path), "LOCKSTEP_KERNEL_ISA": "avx2", "CXX": str(tmp_path / "no-c++")}
    result, log = run_probe(env)
    assert result == "RESULT torch False"
    assert "loading the built avx2 kernels failed" in log
    assert not (build_dir / "built").exists()  # so the next start compiles it again

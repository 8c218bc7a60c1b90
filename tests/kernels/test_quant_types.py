"""The GGUF block types added beside the first ones (Q4_1, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS):
the torch reference against gguf.quants' numpy decode, bitwise; every compiled variant's in-register
decode against the reference, bitwise, on the exact and the int8 path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lockstep.kernels import GGML_BLOCKS, INT8_QTYPES, dequantize
from lockstep.kernels.blocks import linear_int8_reference
from lockstep.testing.kernels import (
    HALF_FIELDS,
    assert_batch_invariant,
    compiled,
    random_blocks,
    variant_params,
)

NEW_TYPES = ["Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS"]


def gguf_dequantize(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


def filled_blocks(qtype: str, n: int, k: int, byte: int, scale: float) -> torch.Tensor:
    """Every byte `byte` but the float16 scales, which are `scale`: the extreme codes of a type."""
    per, nbytes = GGML_BLOCKS[qtype]
    b = torch.full((n * k // per, nbytes), byte, dtype=torch.uint8)
    off, count = HALF_FIELDS[qtype]
    b[:, off:off + 2 * count] = torch.full((b.shape[0], count), scale, dtype=torch.float16).view(torch.uint8)
    return b.reshape(n, -1)


def edge_blocks(qtype: str, k: int) -> list[torch.Tensor]:
    """Random blocks, and blocks of all-zero and all-one bits (the smallest and largest codes,
    scales and mins), with negative and subnormal float16 scales."""
    out = [random_blocks(qtype, 24, k, seed=1)]
    for byte in (0x00, 0xFF, 0x5A):
        for scale in (0.01, -0.003, 3e-6):
            out.append(filled_blocks(qtype, 2, k, byte, scale))
    return out


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_reference_dequantize_is_ggufs_bitwise(qtype: str) -> None:
    for blocks in edge_blocks(qtype, 512):
        ours = dequantize(qtype, blocks, 512)
        assert ours.dtype == torch.float32 and ours.shape == (blocks.shape[0], 512)
        assert torch.equal(ours, gguf_dequantize(qtype, blocks).reshape(ours.shape))


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_every_new_type_has_an_int8_path_close_to_the_exact_product(qtype: str) -> None:
    assert qtype in INT8_QTYPES
    k = 512
    blocks = random_blocks(qtype, 29, k, seed=2)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ dequantize(qtype, blocks, k).double().T
    y = linear_int8_reference(x, blocks, qtype, k)
    assert (y.double() - exact).abs().max().item() < 0.02 * exact.abs().max().item()


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_compiled_exact_path_decodes_bitwise_and_sums_as_on_float32_blocks(variant: str, qtype: str) -> None:
    """The in-register decode gives the reference's floats (the embedding gathers them), and a linear on
    the blocks is bitwise the linear on float32 blocks of those values (the kernels sum in the same
    lane order whatever the type), at every M path: the streaming gemv and the decoded panels."""
    mod = compiled(variant)
    k = 512
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(4))
    for blocks in edge_blocks(qtype, k):
        w = dequantize(qtype, blocks, k)
        ids = torch.arange(blocks.shape[0]).flip(0)
        assert torch.equal(mod.embedding(ids, blocks, qtype, k), w[ids])
        as_f32 = w.contiguous().view(torch.uint8).reshape(w.shape[0], -1)
        for m in (1, 2, 3, 4, 5, 40):
            xm = x[:m].contiguous()
            assert torch.equal(mod.linear(xm, blocks, qtype, k), mod.linear(xm, as_f32, "F32", k)), m
    blocks = random_blocks(qtype, 37, k, seed=5)
    assert_batch_invariant(lambda a: mod.linear(a.contiguous(), blocks, qtype, k), x[:32])


def test_the_variants_agree_bitwise_on_the_new_types() -> None:
    from lockstep.kernels.build import missing_flags

    if missing_flags("avx512"):
        pytest.skip(f"this CPU lacks {', '.join(missing_flags('avx512'))} for avx512")
    x = torch.randn(5, 768)
    for qtype in NEW_TYPES:
        k = 768
        blocks = random_blocks(qtype, 21, k, seed=8)
        for m in (1, 5):
            ys = [compiled(v).linear(x[:m].contiguous(), blocks, qtype, k) for v in ("avx2", "avx512")]
            assert torch.equal(*ys), (qtype, m)


def int8_variant_params() -> list:
    from lockstep.kernels.build import missing_flags

    out = []
    for p in variant_params():
        v = p.values[0]
        lacking = missing_flags("int8_vnni" if v == "avx512" else v)
        out.append(pytest.param(v, marks=pytest.mark.skipif(bool(lacking), reason=f"this CPU lacks {lacking}")))
    return out


@pytest.mark.parametrize("variant", int8_variant_params())
@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_compiled_int8_path_is_the_reference_bitwise(variant: str, qtype: str) -> None:
    """Random and extreme blocks (the largest quant magnitudes against x at +-127: the int16 sums of
    the AVX2 path must not overflow), on the W-rows-in-lanes path (small M), the x-in-lanes panels,
    a fused call of parts of several types, and rows alone vs in a batch."""
    mod = compiled(variant)
    k = 512
    g = torch.Generator().manual_seed(6)
    x = torch.randn(33, k, generator=g) * torch.rand(33, 1, generator=g) * 4
    x[3] = 3.0 * torch.sign(torch.randn(k, generator=g))  # every quant at +-127
    for blocks in edge_blocks(qtype, k):
        for m in (1, 3, 4, 5, 9, 11, 17, 33):
            xm = x[:m].contiguous()
            assert torch.equal(mod.linear_int8(xm, blocks, qtype, k), linear_int8_reference(xm, blocks, qtype, k)), m
    blocks = random_blocks(qtype, 37, k, seed=7)
    assert_batch_invariant(lambda a: mod.linear_int8(a.contiguous(), blocks, qtype, k), x[:20])
    other = random_blocks("Q8_0", 9, k, seed=8)
    for m in (2, 20):
        xm = x[:m].contiguous()
        fused = mod.linear_int8_parts(xm, [blocks, other], [qtype, "Q8_0"], k)
        assert torch.equal(fused, torch.cat([linear_int8_reference(xm, blocks, qtype, k),
                                             linear_int8_reference(xm, other, "Q8_0", k)], dim=1))


GGUF_TYPE_OF = {"attn_q": "Q4_1", "attn_k": "Q5_1", "attn_v": "IQ4_NL", "attn_output": "Q5_K",
                "ffn_gate": "Q2_K", "ffn_up": "Q3_K", "ffn_down": "IQ4_XS", "token_embd": "Q4_1", "output": "Q5_1"}


def test_a_gguf_of_the_new_types_is_served_on_its_blocks(tmp_path, caplog, monkeypatch) -> None:
    """Every new type in one tiny llama GGUF: nothing dequantized at load, every linear multiplies
    by the blocks (exact path: greedy equal to HF on the file's dequantized weights; int8 path: the
    int8 kernels on the same types)."""
    import logging

    # a cache of its own: the model cache, keyed by the file's content, keeps the path it was first
    # read from, which an earlier run's temporary directory no longer has
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))

    from lockstep.layers.block_weight import BlockWeight, Kind
    from lockstep.model_loader import resolve_model
    from lockstep.testing.gguf_writer import QTYPE, write_gguf
    from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
    from lockstep.testing.oracle import greedy_matches, hf_greedy
    from lockstep.testing.tiny_models import tiny_hf_model

    def qtype_of(name: str):  # noqa: ANN202
        return QTYPE[next(t for key, t in GGUF_TYPE_OF.items() if f"{key}." in name)]

    model = tiny_hf_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_gguf(model, "llama", tmp_path / "new_types.gguf", qtype_of=qtype_of)
    prompts = [[1, 10, 200, 7, 42], [1, 99, 150, 3, 60, 61, 62]]
    ref = hf_greedy(resolve_model(str(path)).model_dir, prompts, 8)
    for int8 in (False, True):
        with caplog.at_level(logging.INFO, logger="lockstep.model_loader.weights"):
            sched = make_scheduler(path, max_total_tokens=2048, int8_activations=int8)
        assert not [r for r in caplog.records if "dequantized to float32" in r.message]
        linears = [m for m in sched.worker.runner.model.modules() if hasattr(m, "parts")]
        parts = [p for m in linears for p in m.parts]
        assert linears and all(isinstance(p, BlockWeight) and p.kind == (Kind.INT8 if int8 else Kind.EXACT) for p in parts)
        assert {p.qtype for p in parts} >= set(GGUF_TYPE_OF.values()) - {"Q4_1"}
        got = run_to_completion(sched, [greedy_req(f"r{i}", p, 8) for i, p in enumerate(prompts)])
        for i, r in enumerate(ref):
            if not int8:
                assert greedy_matches(got[f"r{i}"].output_ids, r), i
            else:
                assert len(got[f"r{i}"].output_ids) == 8

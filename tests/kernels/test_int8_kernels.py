"""The opt-in int8 activation path: compiled variants bitwise equal to the torch reference, batch invariant,
and close to the exact float path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lockstep.kernels import INT8_QTYPES, BlockType, dequantize, unpack_for_int8
from lockstep.kernels.blocks import INT8_UNPACKED, linear_int8_reference, quantize_int8
from lockstep.testing.kernels import (
    assert_batch_invariant,
    compiled,
    random_blocks,
    variant_params,
)


def int8_variant_params() -> list:
    """The compiled variants this CPU runs the int8 path of (AVX-512's needs VNNI)."""
    from lockstep.kernels.build import missing_flags

    out = []
    for p in variant_params():
        v = p.values[0]
        lacking = missing_flags("int8_vnni" if v == "avx512" else v)
        mark = pytest.mark.skipif(bool(lacking), reason=f"this CPU lacks {', '.join(lacking)} for {v} int8")
        out.append(pytest.param(v, marks=mark))
    return out


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Activation-like rows: a spread of magnitudes, an outlier, an all-zero block, a tiny block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[0, 5] = 60.0
    x[-1, 32:64] = 0.0
    x[m // 2, :32] *= 1e-30
    return x


def test_reference_quantization_is_round_half_even_per_block() -> None:
    x = torch.zeros(2, 64)
    x[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # d = 1: halves go to the even neighbour
    x[1, 32] = 1e-39  # d below the smallest normal float: the block is zeros
    q, d = quantize_int8(x)
    assert q.dtype == torch.int8 and d.dtype == torch.float32 and d.shape == (2, 2)
    assert q[0, :4].tolist() == [127, 0, 2, -2] and d[0, 0].item() == 1.0
    assert d[0, 1].item() == 0.0 and not q[0, 32:].any()
    assert d[1, 1].item() == 0.0 and not q[1].any()


@pytest.mark.parametrize("qtype", INT8_QTYPES)
def test_reference_is_close_to_the_exact_product(qtype: str) -> None:
    """The arithmetic is what it claims: int8 activation rounding off x @ W.T, nothing else."""
    k = 512
    blocks = random_blocks(qtype, 37, k, seed=3)
    x = activations(9, k, seed=4)
    exact = x.double() @ dequantize(qtype, blocks, k).double().T
    q, d = quantize_int8(x)
    xq = (q.float().reshape(9, -1, 32) * d.unsqueeze(-1)).reshape(9, k)
    rounded = xq.double() @ dequantize(qtype, blocks, k).double().T
    y = linear_int8_reference(x, blocks, qtype, k)
    scale = exact.abs().max().item()
    torch.testing.assert_close(y.double(), rounded, rtol=0, atol=1e-5 * scale)  # float32 sums of the same
    assert (y.double() - exact).abs().max().item() < 0.02 * scale  # and the rounding is small


@pytest.mark.parametrize("variant", int8_variant_params())
def test_compiled_quantization_is_the_reference_bitwise(variant: str) -> None:
    x = activations(19, 640, seed=5)
    q, d = compiled(variant).quantize_int8(x)
    rq, rd = quantize_int8(x)
    assert torch.equal(q, rq) and torch.equal(d, rd)


@pytest.mark.parametrize("variant", int8_variant_params())
@pytest.mark.parametrize("qtype", INT8_QTYPES)
def test_linear_int8_is_the_reference_bitwise_and_batch_invariant(variant: str, qtype: str) -> None:
    mod = compiled(variant)
    k = 512
    for n in (1, 37):  # one row; rows not a multiple of any tile or panel
        blocks = random_blocks(qtype, n, k, seed=n + 20)
        x = activations(64, k, seed=n)
        # W rows in lanes (m <= 10 on AVX2, 8 on AVX-512; chunks of 4), then x rows in lanes (partial, whole
        # and several groups)
        for m in (1, 2, 4, 5, 9, 10, 11, 16, 17, 33, 64):
            xm = x[:m].contiguous()
            assert torch.equal(mod.linear_int8(xm, blocks, qtype, k), linear_int8_reference(xm, blocks, qtype, k))
        assert_batch_invariant(lambda a, b=blocks: mod.linear_int8(a.contiguous(), b, qtype, k), x[:32])


@pytest.mark.parametrize("variant", int8_variant_params())
@pytest.mark.parametrize("qtype", INT8_QTYPES)
def test_extreme_quants_sum_exactly(variant: str, qtype: str) -> None:
    """Every weight quant at its largest magnitude and every x quant at +-127: the integer sums the
    AVX2 path adds up in int16 before widening (blocks.h, kI16Group) must not overflow."""
    from lockstep.kernels import GGML_BLOCKS
    from lockstep.testing.kernels import HALF_FIELDS, UNPACKED_FROM

    stored = UNPACKED_FROM.get(qtype, qtype)  # unpacked from the extreme blocks below
    per, nbytes = GGML_BLOCKS[stored]
    k = 512
    b = torch.full((24 * k // per, nbytes), 0x80 if qtype == "Q8_0" else 0xFF, dtype=torch.uint8)
    off, count = HALF_FIELDS[stored]
    b[:, off:off + 2 * count] = torch.full((b.shape[0], count), 0.01, dtype=torch.float16).view(torch.uint8)
    blocks = unpack_for_int8(stored, b.reshape(24, -1), k)[1] if stored != qtype else b.reshape(24, -1)
    x = torch.ones(17, k) * 3.0
    x[1::2] *= -1
    for m in (1, 5, 17):  # W blocks as stored, and the x-in-lanes panels
        assert torch.equal(compiled(variant).linear_int8(x[:m].contiguous(), blocks, qtype, k),
                           linear_int8_reference(x[:m].contiguous(), blocks, qtype, k)), m


@pytest.mark.parametrize("variant", int8_variant_params())
def test_panels_and_strided_shards(variant: str) -> None:
    """More rows than one panel (the last one partial), K past one panel's budget, more x rows than one
    pass, and a row-parallel shard (a column slice of whole blocks) served without a copy."""
    mod = compiled(variant)
    blocks = random_blocks("Q4_K", 203, 2048, seed=30)
    x = activations(300, 2048, seed=31)  # two passes over x (256 rows each), the second partial
    assert torch.equal(mod.linear_int8(x, blocks, "Q4_K", 2048), linear_int8_reference(x, blocks, "Q4_K", 2048))
    shard = blocks[:, 144 * 2 : 144 * 4]
    assert not shard.is_contiguous()
    assert torch.equal(mod.linear_int8(x[:, :512].contiguous(), shard, "Q4_K", 512),
                       linear_int8_reference(x[:, :512].contiguous(), shard.contiguous(), "Q4_K", 512))


@pytest.mark.parametrize("variant", int8_variant_params())
def test_an_output_past_the_caches_is_the_reference_bitwise(variant: str) -> None:
    """A vocabulary-wide output at a decode batch (over 8 MiB: written with non-temporal stores, whole
    runs per x row) with rows not a multiple of the tile or the panel, and x rows not a multiple of 16."""
    n, k, m = 70_003, 64, 33  # 9.2 MB of float32 output
    blocks = random_blocks("Q8_0", n, k, seed=40)
    x = activations(m, k, seed=41)
    assert torch.equal(compiled(variant).linear_int8(x, blocks, "Q8_0", k),
                       linear_int8_reference(x, blocks, "Q8_0", k))


@pytest.mark.parametrize("variant", int8_variant_params())
def test_fused_parts_are_each_part_bitwise(variant: str) -> None:
    """A fused layer's parts of three block types (rows not multiples of a tile, one part narrower
    than a tile, one a strided column slice) in one call: each part's columns are that part's own
    linear_int8, on the rows path (one parallel region over every part) and on the panels."""
    mod = compiled(variant)
    k = 512
    wide = random_blocks("Q8_0", 70, 2 * k, seed=43)
    parts = [(random_blocks("Q5_0", 37, k, seed=41), "Q5_0"), (random_blocks("Q5_0_U8", 9, k, seed=46), "Q5_0_U8"),
             (random_blocks("Q4_K", 5, k, seed=42), "Q4_K"), (random_blocks("Q4_K_S8", 7, k, seed=47), "Q4_K_S8"),
             (wide[:, : wide.shape[1] // 2], "Q8_0"), (random_blocks("Q6_K", 64, k, seed=44), "Q6_K")]
    x = activations(33, k, seed=45)
    for m in (1, 3, 10, 11, 33):
        xm = x[:m].contiguous()
        y = mod.linear_int8_parts(xm, [b for b, _ in parts], [q for _, q in parts], k)
        own = torch.cat([mod.linear_int8(xm, b, q, k) for b, q in parts], dim=1)
        ref = torch.cat([linear_int8_reference(xm, b.contiguous(), q, k) for b, q in parts], dim=1)
        assert torch.equal(y, own) and torch.equal(y, ref), m


@pytest.mark.parametrize("variant", int8_variant_params())
@pytest.mark.parametrize("stored", sorted(INT8_UNPACKED))
def test_unpacked_layouts_are_the_stored_type_bitwise(variant: str, stored: str) -> None:
    """What the int8 path serves for a Q5_0 or Q4_K weight (the weight plan unpacks it at load)
    gives every number the GGUF's blocks give: dequantized, and through the kernel in both its paths."""
    from lockstep.layers.block_weight import BlockWeight, Kind
    from lockstep.layers.weight_plan import Target, WeightPlan

    mod = compiled(variant)
    k = 768
    raw = random_blocks(stored, 70, k, seed=50)
    kind, unpacked = unpack_for_int8(stored, raw, k)
    assert kind == INT8_UNPACKED[stored] and unpacked.shape == (70, k // kind.per_block * kind.nbytes)
    assert torch.equal(dequantize(kind, unpacked, k), dequantize(stored, raw, k))
    x = activations(17, k, seed=51)
    for m in (1, 4, 10, 11, 17):
        xm = x[:m].contiguous()
        assert torch.equal(mod.linear_int8(xm, unpacked, kind, k), mod.linear_int8(xm, raw, stored, k)), m
    plan = WeightPlan(Target.here("cpu", torch.float32, int8_activations=True))
    (part,) = plan.parts([BlockWeight(raw, BlockType(stored), k)])
    assert part.qtype == kind and part.kind is Kind.INT8 and torch.equal(part.blocks, unpacked)
    assert part.stored_type == stored and not plan.fallbacks


def test_variants_agree_bitwise() -> None:
    from lockstep.kernels.build import missing_flags

    if missing_flags("int8_vnni"):
        pytest.skip(f"this CPU lacks {', '.join(missing_flags('int8_vnni'))} for the avx512 int8 path")
    x = activations(21, 768, seed=8)
    for qtype in ("Q8_0", "Q5_0", "Q5_0_U8", "Q4_0", "Q4_K_S8", "Q6_K_U8"):
        blocks = random_blocks(qtype, 45, 768, seed=9)
        ys = [compiled(v).linear_int8(x, blocks, qtype, 768) for v in ("avx2", "avx512")]
        assert torch.equal(*ys), qtype


@pytest.mark.parametrize("variant", int8_variant_params())
def test_gemma_gguf_weights_head_and_a_layer(variant: str, gemma_gguf) -> None:
    """Gemma 3 270M's own blocks: the tied 262k Q8_0 head alone vs in a batch, and its Q4_K / Q6_K / Q5_0
    linears against the reference."""
    mod = compiled(variant)
    tensors = {t.name: t for t in gemma_gguf.tensors}
    head = torch.from_numpy(np.array(tensors["token_embd.weight"].data))
    x = activations(3, 640, seed=12)
    y = mod.linear_int8(x, head, "Q8_0", 640)
    assert y.shape == (3, 262144) and torch.equal(mod.linear_int8(x[1:2].contiguous(), head, "Q8_0", 640)[0], y[1])
    assert torch.equal(y[:, :4096], linear_int8_reference(x, head[:4096], "Q8_0", 640))
    for t in gemma_gguf.tensors:
        qtype = t.tensor_type.name
        if t.name.startswith("blk.0.") and qtype in INT8_QTYPES:
            k = int(t.shape[0])
            w = torch.from_numpy(np.array(t.data))
            xk = activations(18, k, seed=k)
            assert torch.equal(mod.linear_int8(xk, w, qtype, k), linear_int8_reference(xk, w, qtype, k)), t.name
            if qtype in INT8_UNPACKED:  # as the int8 path serves it
                kind, unpacked = unpack_for_int8(qtype, w, k)
                assert torch.equal(mod.linear_int8(xk, unpacked, kind, k), linear_int8_reference(xk, w, qtype, k)), t.name


def test_public_api() -> None:
    from lockstep.kernels import compiled, kernel_variant, linear_int8
    from lockstep.kernels.build import missing_flags

    blocks = random_blocks("Q5_0", 40, 256, seed=13)
    x = activations(6, 256, seed=14)
    assert torch.equal(linear_int8(x, blocks, "Q5_0", 256), linear_int8_reference(x, blocks, "Q5_0", 256))
    variant = kernel_variant()
    expect = variant == "avx2" or (variant == "avx512" and not missing_flags("int8_vnni"))
    assert compiled("linear_int8") == expect
    with pytest.raises(ValueError, match="no int8 path for F16"):
        linear_int8(x, random_blocks("F16", 4, 256, seed=1), "F16", 256)
    with pytest.raises(ValueError, match=r"float32 x \[M, 256\]"):
        linear_int8(x.double(), blocks, "Q5_0", 256)

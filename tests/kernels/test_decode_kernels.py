"""The compiled decode attention and row argmax against their torch references, on every variant this CPU runs."""

from __future__ import annotations

import pytest
import torch

from lockstep.kernels import argmax, decode_attention, ops
from lockstep.kernels.dispatch import build_table
from lockstep.kernels.reference import decode_attention as decode_attention_reference
from lockstep.testing.kernels import compiled, variant_params

# (query heads, KV heads, head dim): Gemma 3 270M's 4:1 at 256, 4:1 at 64, no grouping, 3:1 at 80 (not a
# multiple of 32), the tiny test models' 16
SHAPES = [(4, 1, 256), (8, 2, 64), (2, 2, 128), (6, 2, 80), (4, 2, 16)]


def make_pool(h: int, hkv: int, d: int, lens: list[int], seed: int = 0):
    """A K/V pool with every request's keys on shuffled slots, as a pool fragments over time."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    size = total + 7
    k_buf = torch.randn(size, hkv, d, generator=g)
    v_buf = torch.randn(size, hkv, d, generator=g)
    slots = torch.randperm(size - 1, generator=g)[:total] + 1
    lens_t = torch.tensor(lens, dtype=torch.int64)
    starts = torch.cumsum(lens_t, 0) - lens_t
    q = torch.randn(len(lens), h, d, generator=g) * 2.0  # peaked enough that softmax is not uniform
    return q, k_buf, v_buf, slots, starts, lens_t


def run(variant: str, q, k_buf, v_buf, slots, starts, lens, scaling, softcap, window) -> torch.Tensor:
    return compiled(variant).decode_attention(q, k_buf, v_buf, slots, starts, lens, scaling,
                                              softcap or 0.0, window or 0)


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("softcap", "window"), [(None, None), (None, 512), (50.0, None), (20.0, 16)])
def test_decode_attention_matches_reference_and_is_batch_invariant(variant, shape, softcap, window) -> None:
    h, hkv, d = shape
    lens = [1, 2, 7, 16, 17, 100, 255, 256, 257, 511, 513, 600]
    q, k_buf, v_buf, slots, starts, lens_t = make_pool(h, hkv, d, lens, seed=d + h)
    args = (0.1, softcap, window)
    out = run(variant, q, k_buf, v_buf, slots, starts, lens_t, *args)
    ref = decode_attention_reference(q.double(), k_buf.double(), v_buf.double(), slots, starts, lens_t, *args)
    assert out.shape == (len(lens), h * d) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    for i in range(len(lens)):
        alone = run(variant, q[i:i + 1], k_buf, v_buf, slots, starts[i:i + 1], lens_t[i:i + 1], *args)
        assert torch.equal(alone[0], out[i]), f"request {i} (len {lens[i]}) differs alone vs in the batch"
    perm = torch.randperm(len(lens), generator=torch.Generator().manual_seed(3))
    assert torch.equal(run(variant, q[perm], k_buf, v_buf, slots, starts[perm], lens_t[perm], *args), out[perm])


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("window", [None, 64])
def test_a_prefill_attends_each_row_as_its_decode_would(variant, window) -> None:
    """Hundreds of rows (a prefill: one request's causal rows, beside a second request) take the
    many-rows path, whole rows per task; each row's bits must be those of the row alone (the
    few-rows path, a decode), the prefix-cache and speculation invariant."""
    n = 300
    q, k_buf, v_buf, slots, _, _ = make_pool(4, 1, 256, [n + 40])
    starts = torch.tensor([0] * n + [n] * 40, dtype=torch.int64)  # request 2 owns the last 40 slots
    lens = torch.cat([torch.arange(1, n + 1), torch.arange(1, 41)])
    q = torch.randn(n + 40, 4, 256, generator=torch.Generator().manual_seed(1)) * 2.0
    args = (0.0625, None, window)
    out = run(variant, q, k_buf, v_buf, slots, starts, lens, *args)
    for i in [0, 1, 63, 64, 65, 255, 256, 257, 299, 300, 339]:
        alone = run(variant, q[i:i + 1], k_buf, v_buf, slots, starts[i:i + 1], lens[i:i + 1], *args)
        assert torch.equal(alone[0], out[i]), f"row {i} differs in a prefill vs alone"


@pytest.mark.parametrize("variant", variant_params())
def test_decode_attention_reads_q_rows_from_a_fused_qkv_view(variant) -> None:
    lens = [5, 300, 40]
    q, k_buf, v_buf, slots, starts, lens_t = make_pool(4, 1, 64, lens)
    qkv = torch.cat([q.reshape(3, -1), torch.randn(3, 2 * 64)], dim=1)  # [R, (H + 2 Hkv) D]
    view = qkv[:, :4 * 64].view(3, 4, 64)
    assert not view.is_contiguous()
    assert torch.equal(run(variant, view, k_buf, v_buf, slots, starts, lens_t, 0.1, None, None),
                       run(variant, q, k_buf, v_buf, slots, starts, lens_t, 0.1, None, None))


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("softcap", "window"), [(None, None), (30.0, 64)])
def test_a_16_bit_pool_gives_the_bits_of_its_values_in_float32(variant, kv_dtype, softcap, window) -> None:
    """--kv-cache-dtype float16 (the int8 path's default) / bfloat16: the kernel widens each stored
    value exactly, so its output is bitwise the float32 pool's holding the rounded values, with the
    many-rows (prefill) path and batch invariance as before; the reference serves the same numbers."""
    lens = [1, 17, 256, 300, 513] + [40] * 40  # 45 rows: the many-rows path on two threads
    q, k_buf, v_buf, slots, starts, lens_t = make_pool(4, 1, 256, lens, seed=5)
    k16, v16 = k_buf.to(kv_dtype), v_buf.to(kv_dtype)
    args = (0.0625, softcap, window)
    out = run(variant, q, k16, v16, slots, starts, lens_t, *args)
    assert torch.equal(out, run(variant, q, k16.float(), v16.float(), slots, starts, lens_t, *args))
    for i in (0, 3, 44):
        alone = run(variant, q[i:i + 1], k16, v16, slots, starts[i:i + 1], lens_t[i:i + 1], *args)
        assert torch.equal(alone[0], out[i])
    ref = decode_attention_reference(q, k16, v16, slots, starts, lens_t, *args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert decode_attention(q, k16, v16, slots, starts, lens_t, *args).dtype == torch.float32


def test_decode_attention_variants_agree_bitwise() -> None:
    from lockstep.kernels.build import missing_flags

    if missing_flags("avx512") or missing_flags("avx2"):
        pytest.skip("needs a CPU that runs both variants")
    lens = [3, 140, 300, 700]
    q, k_buf, v_buf, slots, starts, lens_t = make_pool(4, 1, 256, lens)
    for kv in (torch.float32, torch.float16):
        k, v = k_buf.to(kv), v_buf.to(kv)
        for args in ((0.0625, None, None), (0.0625, 30.0, 512)):
            assert torch.equal(run("avx2", q, k, v, slots, starts, lens_t, *args),
                               run("avx512", q, k, v, slots, starts, lens_t, *args))


@pytest.mark.parametrize("variant", variant_params())
def test_decode_attention_rejects_slots_outside_the_pool(variant) -> None:
    q, k_buf, v_buf, slots, starts, lens_t = make_pool(4, 1, 64, [5])
    bad = slots.clone()
    bad[2] = k_buf.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        run(variant, q, k_buf, v_buf, bad, starts, lens_t, 0.1, None, None)
    with pytest.raises(RuntimeError, match="out of range"):
        run(variant, q, k_buf, v_buf, slots, starts, lens_t + 1, 0.1, None, None)


def test_public_api_falls_back_to_the_reference(monkeypatch) -> None:
    q, k_buf, v_buf, slots, starts, lens_t = make_pool(4, 1, 24, [4, 9])  # 24: not a multiple of 16
    args = (q, k_buf, v_buf, slots, starts, lens_t, 0.1, None, 4)
    assert torch.equal(decode_attention(*args), decode_attention_reference(*args))
    monkeypatch.setattr(ops, "table", lambda: build_table("torch", None))
    x = torch.randn(3, 1000)
    assert torch.equal(argmax(x), x.argmax(-1))
    q, k_buf, v_buf, slots, starts, lens_t = make_pool(4, 1, 64, [4, 9])
    args = (q, k_buf, v_buf, slots, starts, lens_t, 0.1, None, None)
    assert torch.equal(decode_attention(*args), decode_attention_reference(*args))


def argmax_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(32, 262144, generator=g)
    ties = torch.randint(0, 3, (5, 70001), generator=g).float()  # many equal maxima, across segments
    edge = torch.randn(6, 65537, generator=g)
    edge[0] = float("-inf")  # a fully masked row
    edge[1, 40000] = float("inf")
    edge[2, 100] = float("nan")
    edge[2, 50000] = float("nan")
    edge[3, 65536] = 100.0  # the tail element, past the last whole vector
    edge[4, 32768] = edge[4, 3] = 50.0  # tie between segments: the first segment wins
    edge[5, :] = 0.0
    edge[5, 7] = -0.0
    return [big, big[:1], ties, edge, torch.randn(4, 3, generator=g), big[:, 5:70000]]


@pytest.mark.parametrize("variant", variant_params())
def test_argmax_rows_equals_torch(variant) -> None:
    for x in argmax_cases():
        assert torch.equal(compiled(variant).argmax_rows(x), x.max(dim=-1).indices)
        assert torch.equal(compiled(variant).argmax_rows(x), x.argmax(dim=-1))


def test_a_decode_attends_the_same_alone_and_beside_a_prefill() -> None:
    """PagedAttention on CPU: a one-query request's output is bitwise the same in a decode batch of
    its own and in a mixed batch, beside a prefill (which takes SDPA)."""
    from lockstep.forward_batch import ForwardBatch, ForwardMode
    from lockstep.layers.attention import PagedAttention
    from lockstep.mem_cache.memory_pool import TokenToKVPool

    h, hkv, d, prefix = 4, 1, 64, 40
    g = torch.Generator().manual_seed(11)
    pool = TokenToKVPool(128, range(1), hkv, d, torch.float32, "cpu")
    pool.k_buffer[0][1:prefix + 1] = torch.randn(prefix, hkv, d, generator=g)
    pool.v_buffer[0][1:prefix + 1] = torch.randn(prefix, hkv, d, generator=g)
    req_to_token = torch.zeros(2, 64, dtype=torch.int64)
    req_to_token[0, :prefix + 1] = torch.arange(1, prefix + 2)  # the decode: 40 keys + its new one
    req_to_token[1, :6] = torch.arange(60, 66)  # a prefill of 6
    attn = PagedAttention(0, h, hkv, d, d**-0.5, window=16)
    q, k, v = torch.randn(7, h, d, generator=g), torch.randn(7, hkv, d, generator=g), torch.randn(7, hkv, d, generator=g)

    def run(mode, rows, reqs, prefix_lens, extend_lens, slots):
        t = torch.tensor
        fb = ForwardBatch(mode, t([0] * len(rows)), t([0] * len(rows)), t(slots), t(reqs), t(prefix_lens),
                          t(extend_lens), t([0]))
        fb.build_attention(req_to_token, {16})
        return attn(q[rows], k[rows], v[rows], fb, pool)

    alone = run(ForwardMode.DECODE, [0], [0], [prefix], [1], [prefix + 1])
    prefill_slots = list(range(60, 66))
    mixed = run(ForwardMode.MIXED, [1, 2, 3, 4, 5, 6, 0], [1, 0], [0, prefix], [6, 1], [*prefill_slots, prefix + 1])
    assert mixed.shape == (7, h * d)
    assert torch.equal(mixed[6], alone[0])

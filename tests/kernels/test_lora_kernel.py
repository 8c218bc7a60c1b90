"""kernels.lora_sgmv (csrc/lora.cpp): every compiled variant bitwise against a torch emulation of its
stated arithmetic, with float32, bfloat16 and int8 slots (widened to float32 as read), each row the
same bits alone and in any batch, and the torch reference (what serves without a compiler, or off
the CPU) close to it and batch invariant too."""

from __future__ import annotations

import pytest
import torch

from lockstep.kernels import reference
from lockstep.kernels.dispatch import build_table
from lockstep.testing.kernels import compiled, variant_params

SPLITS = [0, 40, 56, 77]  # three modules, widths off the 16-lane vectors (tails)
R, K = 8, 96


DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def operands(seed: int = 0, t: int = 13, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """y, x, a, b, scales, ranks, slots: three slots (one leaves a module out, one of low rank),
    rows of the base (-1), runs of one slot longer than a tile, and a slot's rows apart; each A
    row's scale random (the kernel takes any, whatever the slots' type)."""
    g = torch.Generator().manual_seed(seed)
    n, m = SPLITS[-1], len(SPLITS) - 1
    if dtype == torch.int8:
        a = torch.randint(-127, 128, (3, m * R, K), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (3, R, n), generator=g, dtype=torch.int8)
    else:
        a = torch.randn(3, m * R, K, generator=g).to(dtype)
        b = (torch.randn(3, R, n, generator=g) * 0.1).to(dtype)
    scales = torch.rand(3, m * R, generator=g) + 0.5
    if dtype == torch.int8:  # as lora/layers.py's row scales bring int8 values back to an adapter's size
        scales = scales * 2e-5
    ranks = torch.tensor([[5, 0, 8], [8, 8, 8], [1, 3, 2]])
    slots = torch.tensor([-1, 0, 0, 0, 0, 0, 2, 1, -1, 0, 2, 1, 1][:t])
    return torch.randn(t, n, generator=g), torch.randn(t, K, generator=g), a, b, scales, ranks, slots


def emulate(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
            ranks: torch.Tensor, slots: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """csrc/lora.cpp's arithmetic contract step by step in torch (separate products and sums), the
    slots widened to float32 first (exact for bfloat16 and int8)."""
    out, a, b = y.clone(), a.float(), b.float()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for m, r in enumerate(ranks[s].tolist()):
            if not r:
                continue
            prods = x[t].view(-1, 32)[None] * a[s, m * R:m * R + r].view(r, -1, 32)  # [r, K / 32, 32]
            acc = torch.zeros(r, 32)
            for c in range(prods.shape[1]):
                acc = acc + prods[:, c]
            for w in (16, 8, 4, 2, 1):
                acc = acc[:, :w] + acc[:, w:2 * w]
            u = acc[:, 0] * scales[s, m * R:m * R + r]
            lo, hi = splits[m], splits[m + 1]
            d = torch.zeros(hi - lo)
            for j in range(r):
                d = d + b[s, j, lo:hi] * u[j]
            out[t, lo:hi] = out[t, lo:hi] + d
    return out


def run(fn, y: torch.Tensor, *args) -> torch.Tensor:  # noqa: ANN001 - an in-place op
    out = y.clone()
    fn(out, *args, SPLITS)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", variant_params())
def test_compiled_is_its_contract_bitwise(variant: str, dtype: torch.dtype) -> None:
    y, x, a, b, scales, ranks, slots = operands(dtype=dtype)
    got = run(compiled(variant).lora_sgmv, y, x, a, b, scales, ranks, slots)
    assert torch.equal(got, emulate(y, x, a, b, scales, ranks, slots, SPLITS))
    assert torch.equal(got[slots < 0], y[slots < 0])  # the base's rows untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [*variant_params(), "torch"])
def test_each_row_is_the_same_alone_and_in_any_batch(fn: str, dtype: torch.dtype) -> None:
    op = reference.lora_sgmv if fn == "torch" else compiled(fn).lora_sgmv
    y, x, a, b, scales, ranks, slots = operands(seed=1, dtype=dtype)
    batch = run(op, y, x, a, b, scales, ranks, slots)
    for i in range(len(slots)):
        alone = run(op, y[i:i + 1], x[i:i + 1], a, b, scales, ranks, slots[i:i + 1])
        assert torch.equal(alone[0], batch[i]), f"row {i} differs alone vs in the batch"
    order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(2))
    shuffled = run(op, y[order], x[order], a, b, scales, ranks, slots[order])
    assert torch.equal(shuffled, batch[order])
    # a long run of one slot: rows of 4-row tiles and tails alike
    long = torch.zeros(11, dtype=torch.int64) + 1
    y2, x2 = torch.randn(11, SPLITS[-1]), torch.randn(11, K)
    many = run(op, y2, x2, a, b, scales, ranks, long)
    for i in (0, 3, 4, 10):
        assert torch.equal(run(op, y2[i:i + 1], x2[i:i + 1], a, b, scales, ranks, long[i:i + 1])[0], many[i])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", variant_params())
def test_the_reference_is_close_and_the_table_dispatches(variant: str, dtype: torch.dtype) -> None:
    """Float rounding apart (torch's matmul sums in its own order): a few float32 ulps of the
    products, bfloat16 and int8 slots too (both widen the same values exactly)."""
    y, x, a, b, scales, ranks, slots = operands(seed=3, dtype=dtype)
    kernel = run(compiled(variant).lora_sgmv, y, x, a, b, scales, ranks, slots)
    torch.testing.assert_close(run(reference.lora_sgmv, y, x, a, b, scales, ranks, slots), kernel, rtol=1e-5, atol=1e-5)
    table = build_table(variant, compiled(variant).mod)
    assert torch.equal(run(table.lora_sgmv, y, x, a, b, scales, ranks, slots), kernel)
    # operands the kernel does not take (K off whole groups of 32) run the reference
    x_odd, a_odd = x[:, :80].contiguous(), a[:, :, :80].contiguous()
    assert torch.equal(run(table.lora_sgmv, y, x_odd, a_odd, b, scales, ranks, slots),
                       run(reference.lora_sgmv, y, x_odd, a_odd, b, scales, ranks, slots))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("fn", [*variant_params(), "torch"])
def test_slots_as_views_into_one_buffer_per_slot(fn: str, dtype: torch.dtype) -> None:
    """The slots as lora/layers.py lays them out (each slot's A and B views into one buffer per slot,
    so the slots lie a whole buffer apart): the same bits as the same slots stacked contiguously,
    through the dispatch table (which must not route the views to the reference)."""
    y, x, a, b, scales, ranks, slots = operands(seed=4, dtype=dtype)
    buffer = torch.zeros(a.shape[0], a[0].numel() + 48 + b[0].numel(), dtype=a.dtype)
    a_view = buffer[:, :a[0].numel()].view(a.shape)
    b_view = buffer[:, a[0].numel() + 48:].view(b.shape)
    a_view.copy_(a)
    b_view.copy_(b)
    assert not a_view.is_contiguous() and not b_view.is_contiguous()
    op = reference.lora_sgmv if fn == "torch" else build_table(fn, compiled(fn).mod).lora_sgmv
    assert fn == "torch" or op.takes(y, x, a_view, b_view, scales, ranks, slots, SPLITS)
    assert torch.equal(run(op, y, x, a_view, b_view, scales, ranks, slots), run(op, y, x, a, b, scales, ranks, slots))


def test_no_adapter_rows_add_nothing() -> None:
    y, x, a, b, scales, ranks, _ = operands()
    none = torch.full((len(y),), -1)
    assert torch.equal(run(reference.lora_sgmv, y, x, a, b, scales, ranks, none), y)

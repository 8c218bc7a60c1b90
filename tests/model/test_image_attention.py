"""Image rows see their whole image (Gemma 3's bidirectional block, HF's token_type_ids mask) on
both attention paths, against attention written out with HF's mask (causal OR same image, AND the
sliding window), with a prefix already cached and two requests of different lengths: the GPU
path's padded-grid masks and the CPU rows exactly, on full and on sliding-window layers (an image
row's window counted back from its own position, not from its image's end)."""

from __future__ import annotations

import pytest
import torch

from lockstep.forward_batch import ForwardBatch, ForwardMode
from lockstep.layers.attention import PagedAttention
from lockstep.mem_cache.memory_pool import TokenToKVPool
from lockstep.multimodal.refs import ImageRef
from lockstep.multimodal.spans import rows_in_pass

H, HKV, D = 4, 2, 16


def _batch() -> tuple[ForwardBatch, torch.Tensor]:
    """Request 0: 3 cached tokens, extends 9 with an image at positions 5..8; request 1: extends 6
    with an image at 1..3. Slots: request 0 at 0..11, request 1 at 20..25."""
    reqs = [(3, 9, ImageRef("a" * 64, "x", (3, 1, 1), 5, 4), list(range(12))),
            (0, 6, ImageRef("b" * 64, "y", (3, 1, 1), 1, 3), list(range(20, 26)))]
    req_to_token = torch.zeros(2, 32, dtype=torch.int64)
    rows, floors, row0, locs = [], [], 0, []
    for i, (pre, ext, im, slots) in enumerate(reqs):
        req_to_token[i, :len(slots)] = torch.tensor(slots)
        r, f = rows_in_pass([im], pre, pre + ext, row0)
        rows += r
        floors += f
        locs += slots[pre:pre + ext]
        row0 += ext
    t = sum(e for _, e, _, _ in reqs)
    fb = ForwardBatch(
        ForwardMode.EXTEND, torch.zeros(t, dtype=torch.int64),
        torch.cat([torch.arange(p, p + e) for p, e, _, _ in reqs]), torch.tensor(locs),
        torch.tensor([0, 1]), torch.tensor([p for p, _, _, _ in reqs]),
        torch.tensor([e for _, e, _, _ in reqs]), torch.arange(t), images=rows, image_key_floors=floors)
    return fb, req_to_token


def _reference(q: torch.Tensor, fb: ForwardBatch, req_to_token: torch.Tensor, pool: TokenToKVPool,
               window: int | None) -> torch.Tensor:
    """Every row's attention over its request's keys under HF's mask, written out."""
    ends = {}
    for first, count, keys in fb.image_key_floors:
        ends.update({r: keys for r in range(first, first + count)})
    out, row = [], 0
    for b in range(fb.batch_size):
        pre, ext = int(fb.prefix_lens[b]), int(fb.extend_lens[b])
        slots = req_to_token[b, :pre + ext]
        keys, vals = pool.k_buffer[0][slots], pool.v_buffer[0][slots]  # [L, HKV, D]
        for p in range(pre, pre + ext):
            k_idx = torch.arange(pre + ext)
            seen = (k_idx <= p) | (k_idx < ends.get(row, 0))
            if window is not None:
                seen &= p - k_idx < window
            kq = keys.repeat_interleave(H // HKV, 1)  # [L, H, D]
            scores = torch.einsum("hd,lhd->hl", q[row], kq) * D**-0.5
            probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            out.append(torch.einsum("hl,lhd->hd", probs, vals.repeat_interleave(H // HKV, 1)).reshape(-1))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 4])
def test_image_rows_see_their_image_on_both_paths(window):
    fb, req_to_token = _batch()
    assert fb.image_key_floors == [(2, 4, 9), (10, 3, 4)]
    gen = torch.Generator().manual_seed(0)
    pool = TokenToKVPool(32, range(1), HKV, D, torch.float32, "cpu")
    pool.k_buffer[0].normal_(generator=gen)  # the cached prefix's keys and values
    pool.v_buffer[0].normal_(generator=gen)
    t = fb.input_ids.numel()
    q, k, v = (torch.randn(t, n, D, generator=gen) for n in (H, HKV, HKV))
    attn = PagedAttention(0, H, HKV, D, D**-0.5, window)
    fb.build_attention(req_to_token, {window})
    rows = attn(q, k, v, fb, pool)
    fb.build_attention(req_to_token, {window}, grid=True)
    grid = attn._batched(q, fb, fb.attn, pool)
    ref = _reference(q, fb, req_to_token, pool, window)
    torch.testing.assert_close(grid, ref, rtol=1e-5, atol=1e-5)
    # CPU rows: request 0's image rows 2..5 are positions 5..8; with a window of 4 HF starts
    # their window at p - 3, not at the image's end - 4 = 5 (what the kernel's own window, counted
    # back from the raised key count, would give: rows 2..4 would differ)
    torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5)
    fb.image_key_floors = []  # causal only: the image rows' numbers change
    fb.build_attention(req_to_token, {window})
    causal = attn(q, k, v, fb, pool)
    assert not torch.allclose(causal[2:5], rows[2:5]) and torch.equal(causal[6:9], rows[6:9])

"""The model-facing forward batch: flat tokens of the whole batch plus a per-request descriptor,
and the attention metadata every layer reads. Plain torch: the model layer (lockstep.layers,
lockstep.models, lockstep.model_executor) imports this and nothing wire-facing."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

import torch

from lockstep.multimodal.spans import ImageRows


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, prefill chunk or extend-from-prefix
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # prefill chunks and decodes in one batch


@dataclass
class AttentionMetadata:
    """Built once per forward and shared by every layer: where each query row's keys live."""

    # CPU: every request's KV slots back to back, unpadded, and per query row [T] the first of its
    # request's keys in kv_flat and how many it sees (its position + 1). Each row runs alone in the
    # decode kernel, so its numbers never depend on how many rows its request extends by (a
    # prefix-cache hit, a prefill chunk, a speculative verify pass) or on its neighbours.
    kv_flat: torch.Tensor | None = None
    row_kv_starts: torch.Tensor | None = None
    row_kv_lens: torch.Tensor | None = None
    # GPU: one masked SDPA over the padded [B, Q, L] grid: KV slots per request padded with the
    # scratch slot 0, flat token -> row of the [B * Q] query grid, one mask per sliding window.
    kv_indices: torch.Tensor | None = None
    q_scatter: torch.Tensor | None = None
    max_q: int = 1
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # CPU, only where image rows see keys past their position: per sliding window, each row's first
    # key and key count with the window counted back from the row's own position (HF's mask), not
    # from its raised key count; the attention kernel then reads exactly that range.
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B] tokens already in KV before this pass
    extend_lens: torch.Tensor  # [B] new tokens in this pass
    logits_indices: torch.Tensor  # [S] flat positions whose logits are computed
    attn: AttentionMetadata | None = None
    lora_slots: list[int] | None = None  # [B] each request's LoRA slot, -1 the base (lockstep.lora)
    # Image tokens this pass computes (their embeddings come from the vision tower), and per
    # (first row, rows, keys) run how many keys those rows see at least: an image's rows see it whole.
    images: list[ImageRows] = field(default_factory=list)
    image_key_floors: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    def build_attention(self, req_to_token: torch.Tensor, windows: set[int | None],
                        grid: bool | None = None) -> None:
        """`grid`: the padded-grid metadata of the GPU path (default: off a CPU); a CPU test builds
        it too, to check the GPU path's masks against the CPU's rows."""
        b = self.batch_size
        ext, pre = self.extend_lens, self.prefix_lens
        seq = pre + ext
        max_q, max_l = int(ext.max()), int(seq.max())
        device = self.input_ids.device
        kv = req_to_token[self.req_pool_indices, :max_l]
        if not (grid if grid is not None else device.type != "cpu"):
            self.attn = _cpu_row_metadata(kv, ext, pre, seq, max_l, self.image_key_floors, windows)
            return
        q_idx = torch.arange(max_q, device=device)
        k_idx = torch.arange(max_l, device=device)
        starts = torch.cumsum(ext, 0) - ext
        row_of_token = torch.repeat_interleave(torch.arange(b, device=device), ext)
        col_of_token = torch.arange(ext.sum(), device=device) - starts[row_of_token]
        q_pos = pre[:, None] + q_idx[None, :]  # [B, Q] absolute position of each query
        dist = q_pos[:, :, None] - k_idx[None, None, :]  # [B, Q, L]
        causal = dist >= 0
        if self.image_key_floors:  # image rows also see their image's later keys
            floor = torch.zeros(b * max_q, dtype=torch.int64, device=device)
            floor[row_of_token * max_q + col_of_token] = _row_floors(self.image_key_floors, int(ext.sum()), device)
            causal = causal | (k_idx[None, None, :] < floor.view(b, max_q, 1))
        base = causal & (k_idx[None, None, :] < seq[:, None, None])
        padded_q = q_idx[None, :] >= ext[:, None]  # [B, Q]
        masks = {}
        for w in windows:
            m = base if w is None else base & (dist < w)
            # Padding queries see key 0 only, so softmax never divides by zero; they are dropped.
            m = m | (padded_q[:, :, None] & (k_idx == 0)[None, None, :])
            masks[w] = m.unsqueeze(1)
        kv = torch.where(k_idx[None, :] < seq[:, None], kv, 0)
        self.attn = AttentionMetadata(kv_indices=kv, q_scatter=row_of_token * max_q + col_of_token,
                                      max_q=max_q, masks=masks)


def _row_floors(floors: list[tuple[int, int, int]], rows: int, device: torch.device) -> torch.Tensor:
    """[rows] the fewest keys each row sees (0: its causal count)."""
    out = torch.zeros(rows, dtype=torch.int64, device=device)
    for first, count, keys in floors:
        out[first:first + count] = keys
    return out


def _cpu_row_metadata(kv: torch.Tensor, ext: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor,
                      max_l: int, floors: list[tuple[int, int, int]],
                      windows: set[int | None]) -> AttentionMetadata:
    """No masks and no padded grid on a CPU (building masks was a third of a decode step's set-up).
    An image row sees its whole image: its key count is raised to the image's end. A sliding
    window still starts from the row's own position, as HF's mask does (`windowed`); the kernel's
    own window would count back from the raised count and start up to an image later."""
    device = kv.device
    kv_flat = kv[torch.arange(max_l, device=device)[None, :] < seq[:, None]]
    k_starts = torch.cumsum(seq, 0) - seq
    if int(ext.max()) == 1:  # a batch of decodes: one row per request, the common step kept cheap
        return AttentionMetadata(kv_flat, k_starts, seq)
    row_of_token = torch.repeat_interleave(torch.arange(seq.numel(), device=device), ext)
    col_of_token = torch.arange(int(ext.sum()), device=device) - (torch.cumsum(ext, 0) - ext)[row_of_token]
    lens = pre[row_of_token] + col_of_token + 1
    starts = k_starts[row_of_token]
    if not floors:
        return AttentionMetadata(kv_flat, starts, lens)
    raised = torch.maximum(lens, _row_floors(floors, lens.numel(), device))
    windowed = {}
    for w in windows:
        if w:
            lo = (lens - w).clamp(min=0)  # the first key the window shows, from the row's position
            windowed[w] = (starts + lo, raised - lo)
    return AttentionMetadata(kv_flat, starts, raised, windowed=windowed)


def micro_batch_ranges(extend_lens: list[int], n: int) -> list[tuple[int, int]]:
    """Cut requests [0, B) into up to n contiguous [start, end) ranges of about equal token counts
    (decode: request counts), each with a request: equal work keeps every stage equally busy."""
    b = len(extend_lens)
    n = max(1, min(n, b))
    total = sum(extend_lens)
    cuts = [0]
    acc = 0
    for i in range(b - 1):
        acc += extend_lens[i]
        made = len(cuts) - 1  # cuts so far
        if made == n - 1:
            break
        left_after = b - (i + 1)  # requests after a cut here
        parts_after = n - (made + 1)  # ranges that still need a request after a cut here
        # Cut once this range reached its share of tokens, or when waiting longer would leave
        # some later range without a request.
        if acc * n >= total * (made + 1) or left_after == parts_after:
            cuts.append(i + 1)
    return list(zip(cuts, cuts[1:] + [b]))


def split_forward_batch(fb: ForwardBatch, n: int) -> list[ForwardBatch]:
    """Contiguous micro-batches of `fb` for pipeline stages to work on at once (attention metadata
    left to build_attention). Tokens and logits_indices run request after request, so each
    range's tokens follow from extend_lens and its logits rows are one consecutive run of fb's,
    renumbered from 0: concatenated in order, they are exactly fb's."""
    ext = fb.extend_lens.tolist()
    ranges = micro_batch_ranges(ext, n)
    if len(ranges) == 1:
        return [fb]
    li, parts = fb.logits_indices, []
    for start, end in ranges:
        t0, t1 = sum(ext[:start]), sum(ext[:end])
        parts.append(ForwardBatch(
            mode=fb.mode, input_ids=fb.input_ids[t0:t1], positions=fb.positions[t0:t1],
            out_cache_loc=fb.out_cache_loc[t0:t1], req_pool_indices=fb.req_pool_indices[start:end],
            prefix_lens=fb.prefix_lens[start:end], extend_lens=fb.extend_lens[start:end],
            logits_indices=li[(li >= t0) & (li < t1)] - t0,
            lora_slots=fb.lora_slots[start:end] if fb.lora_slots is not None else None,
            images=[dataclasses.replace(r, row=r.row - t0) for r in fb.images if t0 <= r.row < t1],
            image_key_floors=[(f - t0, n, k) for f, n, k in fb.image_key_floors if t0 <= f < t1]))
    return parts

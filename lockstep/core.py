"""The shapes every stage shares, at the bottom of the package: a generated token with its
logprob, the finish reasons, the sampling parameters (one type from the HTTP edge to the sampler),
and the forward batch the model worker runs. Imports nothing of lockstep's own above it except the
grammar constraint a request carries."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, NamedTuple

import torch

from lockstep.constrained import Constraint


class TokenLogprob(NamedTuple):
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    token_id: int
    text: str | None = None  # filled in by the tokenizer manager when the client asks for text


# ---- finish reasons (SGLang's FINISH_* classes); `to_json()` only at the HTTP/Engine edge


@dataclass(frozen=True)
class BaseFinishReason:
    type: ClassVar[str]  # OpenAI's finish_reason: "stop", "length" or "abort"

    def to_json(self) -> dict[str, Any]:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {"type": self.type, **fields}


@dataclass(frozen=True)
class FINISH_MATCHED_TOKEN(BaseFinishReason):  # noqa: N801 - SGLang's names
    matched: int  # a stop token id or an end-of-sequence token
    type: ClassVar[str] = "stop"


@dataclass(frozen=True)
class FINISH_MATCHED_STR(BaseFinishReason):  # noqa: N801
    matched: str  # a stop string or stop_regex pattern (the scheduler's stop_checker finds those)
    type: ClassVar[str] = "stop"


@dataclass(frozen=True)
class FINISH_LENGTH(BaseFinishReason):  # noqa: N801
    length: int
    type: ClassVar[str] = "length"


@dataclass(frozen=True)
class FINISH_ABORT(BaseFinishReason):  # noqa: N801
    """By the client, the server shutting down, or a request that can never run: then
    `status_code` is the HTTP status the client gets."""

    message: str = "aborted"
    status_code: int | None = None
    type: ClassVar[str] = "abort"


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    # Generation stops when the output text matches one of these (RE2, managers/stop_checker.py).
    stop_regex: list[str] = field(default_factory=list)
    # At most one; checked in the front process (lockstep.constrained.validate_constraint).
    constraint: Constraint | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1


# ---- the forward batch: flat tokens of the whole batch plus a per-request descriptor


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

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    def build_attention(self, req_to_token: torch.Tensor, windows: set[int | None]) -> None:
        b = self.batch_size
        ext, pre, seq = self.extend_lens, self.prefix_lens, self.seq_lens
        max_q, max_l = int(ext.max()), int(seq.max())
        device = self.input_ids.device
        kv = req_to_token[self.req_pool_indices, :max_l]
        if device.type == "cpu":
            self.attn = _cpu_row_metadata(kv, ext, pre, seq, max_l)
            return
        q_idx = torch.arange(max_q, device=device)
        k_idx = torch.arange(max_l, device=device)
        starts = torch.cumsum(ext, 0) - ext
        row_of_token = torch.repeat_interleave(torch.arange(b, device=device), ext)
        col_of_token = torch.arange(ext.sum(), device=device) - starts[row_of_token]
        q_pos = pre[:, None] + q_idx[None, :]  # [B, Q] absolute position of each query
        dist = q_pos[:, :, None] - k_idx[None, None, :]  # [B, Q, L]
        base = (dist >= 0) & (k_idx[None, None, :] < seq[:, None, None])
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


def _cpu_row_metadata(kv: torch.Tensor, ext: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor,
                      max_l: int) -> AttentionMetadata:
    """No masks and no padded grid on a CPU (building masks was a third of a decode step's set-up)."""
    device = kv.device
    kv_flat = kv[torch.arange(max_l, device=device)[None, :] < seq[:, None]]
    k_starts = torch.cumsum(seq, 0) - seq
    if int(ext.max()) == 1:  # a batch of decodes: one row per request, the common step kept cheap
        return AttentionMetadata(kv_flat, k_starts, seq)
    row_of_token = torch.repeat_interleave(torch.arange(seq.numel(), device=device), ext)
    col_of_token = torch.arange(int(ext.sum()), device=device) - (torch.cumsum(ext, 0) - ext)[row_of_token]
    return AttentionMetadata(kv_flat, k_starts[row_of_token], pre[row_of_token] + col_of_token + 1)


def micro_batch_ranges(extend_lens: list[int], n: int) -> list[tuple[int, int]]:
    """Cut requests [0, B) into up to n contiguous [start, end) ranges of about equal token
    counts (decode: equal request counts), every range holding at least one request. Equal
    work per micro-batch keeps every pipeline stage equally busy."""
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


def slice_forward_batch(fb: ForwardBatch, start: int, end: int) -> ForwardBatch:
    """The requests [start, end) of `fb` as a batch of their own. Tokens are laid out request
    after request, so the token range follows from extend_lens; logits rows inside it keep
    their order and are renumbered from 0. The attention metadata is left to build_attention."""
    ext = fb.extend_lens.tolist()
    t0, t1 = sum(ext[:start]), sum(ext[:end])
    li = fb.logits_indices
    keep = (li >= t0) & (li < t1)
    return ForwardBatch(
        mode=fb.mode,
        input_ids=fb.input_ids[t0:t1], positions=fb.positions[t0:t1],
        out_cache_loc=fb.out_cache_loc[t0:t1],
        req_pool_indices=fb.req_pool_indices[start:end],
        prefix_lens=fb.prefix_lens[start:end], extend_lens=fb.extend_lens[start:end],
        logits_indices=li[keep] - t0,
    )


def split_forward_batch(fb: ForwardBatch, n: int) -> list[ForwardBatch]:
    """Contiguous micro-batches of `fb` for pipeline stages to work on at once. Their logits
    rows, concatenated in order, are exactly fb's: the worker builds logits_indices in token
    order (request after request), so each micro-batch's rows are one consecutive run of them."""
    ranges = micro_batch_ranges(fb.extend_lens.tolist(), n)
    if len(ranges) == 1:
        return [fb]
    return [slice_forward_batch(fb, a, b) for a, b in ranges]

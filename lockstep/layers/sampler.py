"""Batched sampling over the full vocabulary, each request with its own parameters.

Randomness comes from a counter-based hash of (request seed, step, token id), not from a
global RNG: every TP rank draws the same token without communicating, and the same seed
repeats the same tokens whatever else shares the batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lockstep.kernels import argmax

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B] float; 0 = greedy
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B] int; vocab size = off
    min_ps: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: tokens generated so far (the hash counter)
    # Penalties need per-request token counts; built only when some request uses them.
    frequency_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # [B, V] counts of generated tokens
    seen_mask: torch.Tensor | None = None  # [B, V] prompt or generated
    all_greedy: bool = False
    need_filter: bool = False
    # Constrained decoding: next-token bitmask int32 [R, ceil(V / 32)] (bit i of word w allows
    # token 32w + i) for the rows `vocab_mask_rows` [R]; other rows are not touched at all.
    vocab_mask: torch.Tensor | None = None
    vocab_mask_rows: list[int] | None = None
    # OpenAI's logit_bias: (row, token ids, biases) for the rows that have one; each is added to
    # its own row only, so a biased request leaves its batch neighbours' numbers bit for bit.
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None = None  # [B] logprob of the chosen token (raw logits)
    top_logprobs: torch.Tensor | None = None  # [B, K]
    top_ids: torch.Tensor | None = None  # [B, K]


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V], a pure function of (seed, step, token id)."""
    ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    x = ((seeds[:, None] & _MASK32) * 0x27D4EB2F + steps[:, None] * 0x165667B1 + ids) & _MASK32
    for mult in (0x7FEB352D, 0x846CA68B & 0x7FFFFFFF, 0x5BD1E995):
        x = ((x ^ (x >> 16)) * mult) & _MASK32
    x = x ^ (x >> 15)
    return (x.double() + 0.5) / 4294967296.0


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    if info.output_counts is not None:
        counts = info.output_counts.to(logits.dtype)
        logits = logits - info.frequency_penalties[:, None] * counts
        logits = logits - info.presence_penalties[:, None] * (counts > 0).to(logits.dtype)
    if info.seen_mask is not None:
        rep = info.repetition_penalties[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(info.seen_mask, penalized, logits)
    return logits


# Byte value -> the additive bias of its 8 tokens (0 allowed, -inf not). A table lookup and an
# in-place add per row is the cheapest of the ways measured; masked_fill with a bool mask and
# index_put cost more over a 262k vocabulary (docs/benchmarks.md, "Grammar backend and
# constrained decoding (issue 13)").
_BYTE_BIAS = torch.where(
    ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_vocab_mask_(logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed tokens of `rows` to -inf, in place; the other rows stay bit for bit."""
    vocab = logits.shape[1]
    table = _BYTE_BIAS.to(logits.device, logits.dtype)
    # Viewed as bytes (little-endian, as on every platform torch runs on), byte b of a row holds
    # the bits of tokens 8b .. 8b+7 in order.
    as_bytes = mask.to(logits.device).contiguous().view(torch.uint8).long()
    width = as_bytes.shape[1] * 8
    for i, row in enumerate(rows):
        bias = table.index_select(0, as_bytes[i]).view(width)
        if width >= vocab:
            logits[row].add_(bias[:vocab])
        else:  # the LM head is wider than the tokenizer: tokens past it are never allowed
            logits[row, :width].add_(bias)
            logits[row, width:] = float("-inf")


def sample(logits: torch.Tensor, info: SamplingBatchInfo, top_logprobs_num: int = 0,
           want_logprobs: bool = False) -> SampleOutput:
    """logits: [B, V] float32 raw model logits."""
    raw = logits
    logits = apply_penalties(logits, info)
    if info.vocab_mask is not None or info.logit_bias:
        if logits is raw and (want_logprobs or top_logprobs_num):
            logits = logits.clone()  # logprobs are of the model's own distribution
        for row, ids, bias in info.logit_bias or ():
            logits[row].index_add_(0, ids, bias)
        if info.vocab_mask is not None:
            apply_vocab_mask_(logits, info.vocab_mask, info.vocab_mask_rows)
    next_ids = argmax(logits) if info.all_greedy else _sample_random(logits, info)
    out = SampleOutput(next_ids)
    if want_logprobs or top_logprobs_num:
        logp = torch.log_softmax(raw, dim=-1)
        out.logprobs = logp.gather(1, next_ids[:, None]).squeeze(1)
        if top_logprobs_num:
            out.top_logprobs, out.top_ids = logp.topk(top_logprobs_num, dim=-1)
    return out


def _sample_random(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    greedy = info.temperatures <= 0
    temps = torch.where(greedy, 1.0, info.temperatures)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if info.need_filter:
        probs = filter_probs(probs, info.top_ks, info.top_ps, info.min_ps)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (the Gumbel-max trick).
    noise = -torch.log(hash_uniform(info.seeds, info.steps, probs.shape[-1])).to(probs.dtype)
    sampled = argmax(probs / noise)
    return torch.where(greedy, argmax(logits), sampled)


def filter_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                 min_ps: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside top-k, outside the top-p nucleus, or below min_p * max."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    cum = sorted_p.cumsum(-1)
    drop = ranks >= top_ks[:, None]
    drop |= (cum - sorted_p) > top_ps[:, None]  # keep the token that crosses top_p
    drop |= sorted_p < (min_ps[:, None] * sorted_p[:, :1])
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def counts_matrix(token_lists: Sequence[Sequence[int]], vocab: int, device: str) -> torch.Tensor:
    counts = torch.zeros((len(token_lists), vocab), dtype=torch.int32, device=device)
    for row, toks in enumerate(token_lists):
        if toks:
            t = torch.tensor(toks, dtype=torch.int64, device=device)
            t = t[t < vocab]  # an image's tokens carry ids past the vocabulary: not counted
            counts[row].index_add_(0, t, torch.ones_like(t, dtype=torch.int32))
    return counts

"""A request's scheduling state, and a batch of them ready for the model worker.

A request (`Req`) is its identity and progress (prompt, outputs, phase, finish) plus four records,
each changed only by the code named on it: where its tokens are in KV (`KVState`), what
constrains its next token (`SamplingState`), its speculative draft (`SpecState`) and the
logprobs gathered since its last report (`LogprobState`). Of a request's `fill_ids` (prompt +
generated), `kv.cached_len` have KV in its req->token row; a step extends that to
`kv.device_len`: prefill, chunks, extend-from-prefix, decode and resume-after-retract alike. With
overlap scheduling `cached_len` moves to `device_len` at launch (batches run in order), and a
token still being sampled is `kv.future_token`, a placeholder the next decode step reads;
`output_ids` only ever holds real tokens."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from lockstep.constrained.backend import GrammarMatcher
from lockstep.core import BaseFinishReason, TokenLogprob
from lockstep.forward_batch import ForwardBatch, ForwardMode
from lockstep.layers.sampler import SamplingBatchInfo, counts_matrix
from lockstep.lora.adapter import LoraAdapter
from lockstep.managers.stop_checker import StopChecker
from lockstep.multimodal.refs import ImageRef
from lockstep.multimodal.spans import ImageRows, outside_vocab, rows_in_pass
from lockstep.sampling_params import SamplingParams


class ReqPhase(Enum):  # where a request is in the scheduler (ReqState is the front's record)
    WAITING = "waiting"
    PREFILL = "prefill"  # admitted; prompt (or a chunk of it) being computed
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class KVState:
    """Where the request's tokens are in KV. The scheduler changes it (admission, chunks, the
    prefix tree, release) and its output processor (which computed tokens are kept); the
    overlap loop moves `cached_len` at launch and sets `future_token`."""

    req_pool_idx: int | None = None
    cached_len: int = 0
    device_len: int = 0
    prefix_len: int = 0  # of cached_len, tokens owned by the prefix tree (locked via last_node)
    last_node: Any = None
    # Overlap scheduling: placeholder (< 0) of the token a launched, unprocessed batch samples.
    future_token: int | None = None

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len


@dataclass
class SamplingState:
    """What constrains the request's next tokens beyond its sampling parameters. The scheduler
    sets the stop checker at arrival, its grammar queue the compile and then the grammar; the
    output processor advances both by each sampled token."""

    # Constrained decoding: the grammar's state after `output_ids` (retraction keeps both).
    grammar: GrammarMatcher | None = None
    compiling: Future[GrammarMatcher] | None = None  # the grammar, while the request waits for it
    stops: StopChecker | None = None  # stop strings / stop_regex: the output's text, checked


@dataclass
class SpecState:
    """Speculative decoding, changed only by the Speculator: this step's draft (tokens after the
    last one, verified in one pass) and the drafter's state of this request (an
    ngram_drafter.DraftState, made on its first draft)."""

    draft: list[int] = field(default_factory=list)
    drafter: Any = None


@dataclass
class LogprobState:
    """What the client asked for, and the logprobs gathered since the last report: the output
    processor appends and `take`s them."""

    return_logprob: bool = False
    start_len: int = -1  # logprob_start_len: the first prompt position asked for, -1 none
    top_n: int = 0  # top_logprobs_num
    out: list[TokenLogprob] = field(default_factory=list)
    out_top: list[list[TokenLogprob]] = field(default_factory=list)
    prompt: list[TokenLogprob] = field(default_factory=list)
    prompt_top: list[list[TokenLogprob]] = field(default_factory=list)

    def take(self) -> tuple[list[TokenLogprob], list[list[TokenLogprob]], list[TokenLogprob],
                            list[list[TokenLogprob]]]:
        """(out, out_top, prompt, prompt_top) gathered so far; the record starts over."""
        taken = self.out, self.out_top, self.prompt, self.prompt_top
        self.out, self.out_top, self.prompt, self.prompt_top = [], [], [], []
        return taken


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    arrival: int = 0  # scheduler step at arrival: a logical clock, never wall time
    output_ids: list[int] = field(default_factory=list)
    phase: ReqPhase = ReqPhase.WAITING
    finish_reason: BaseFinishReason | None = None
    retractions: int = 0
    priority: int = 0  # resolved by lockstep.managers.priority (larger or smaller first)
    sent_len: int = 0  # output tokens already reported
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported to clients)
    kv: KVState = field(default_factory=KVState)
    sampling: SamplingState = field(default_factory=SamplingState)
    spec: SpecState = field(default_factory=SpecState)
    logprobs: LogprobState = field(default_factory=LogprobState)
    embedding: list[float] | None = None  # an embedding model's pooled vector, once computed
    lora: LoraAdapter | None = None  # its LoRA adapter (lockstep.lora), None: the base model
    images: list[ImageRef] = field(default_factory=list)  # its tokens carry hash-derived ids

    def limits_error(self, context_len: int, max_req_len: int, vocab_size: int) -> str | None:
        """Why the request can never run here (a 400), or None. `max_req_len` is the smaller of
        the context length and the KV pool."""
        n_prompt, max_new = len(self.origin_input_ids), self.sampling_params.max_new_tokens
        room = context_len - n_prompt
        bad = outside_vocab(self.origin_input_ids, self.images, vocab_size)
        if n_prompt == 0:
            return "the prompt is empty"
        if max_new > room or room <= 0:
            return (f"max_new_tokens ({max_new}) + prompt ({n_prompt} tokens) exceeds the context "
                    f"length {context_len}; at most {max(room, 0)} new tokens fit")
        if n_prompt + max_new > max_req_len:  # a pool smaller than the context
            return (f"max_new_tokens ({max_new}) + prompt ({n_prompt} tokens) exceeds the KV pool "
                    f"of {max_req_len} tokens (--max-total-tokens; the model's context length is "
                    f"{context_len})")
        if bad is not None:
            return f"input_ids: token id {bad} is outside the vocabulary [0, {vocab_size})"
        return None

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def prefix_key(self) -> list[int]:
        """fill_ids as the prefix cache keys them: an adapter's requests in a namespace of their
        own (the load's uid above the 32 bits of a token id), so KV computed under one adapter
        is shared by its requests and never by another adapter's or the base's."""
        if self.lora is None:
            return self.fill_ids
        ns = self.lora.uid << 32
        return [ns | t for t in self.fill_ids]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def sampled_len(self) -> int:
        """Tokens sampled so far, counting one still in flight: the sampler's step number."""
        return len(self.output_ids) + (self.kv.future_token is not None)

    @property
    def prompt_logprob_start(self) -> int | None:
        """First prompt position whose next-token logprob the client asked for, if any."""
        lp = self.logprobs
        if not lp.return_logprob or lp.start_len < 0 or self.output_ids:
            return None
        return min(lp.start_len, len(self.origin_input_ids) - 1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_real_outputs(self) -> bool:
        """Penalties count every output token, not a placeholder, and a grammar's next mask needs
        the token in flight: with overlap, this request's step waits for the previous one."""
        p = self.sampling_params
        return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
                    or self.sampling.grammar is not None)


@dataclass
class ModelWorkerBatch:
    """Everything the worker needs for one forward + sample, and nothing the scheduler keeps."""

    forward_batch: ForwardBatch
    sampling: SamplingBatchInfo
    sample_rows: torch.Tensor  # rows of the logits that are sampled, one per sampling request
    # (row start, count) of prompt-logprob rows per request needing them, else None
    prompt_rows: list[tuple[int, int] | None]
    prompt_targets: torch.Tensor  # [total prompt rows] the token each prompt row predicts
    top_logprobs_num: int
    return_logprob: bool


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    mode: ForwardMode
    # How many tokens each request samples this step: 0 for a chunk that ends mid-prompt, else 1,
    # or 1 + its draft's length in a speculative verify pass (its last 1 + k rows are sampled).
    samples: list[int] = field(default_factory=list)
    out_cache_loc: torch.Tensor | None = None  # KV slots for this step's new tokens
    worker_batch: ModelWorkerBatch | None = None
    # Tokens each request computes, recorded when scheduled (an overlap launch moves cached_len).
    extend_lens: list[int] = field(default_factory=list)

    def fingerprint(self) -> str:
        desc = repr((self.mode.value, [(r.rid, r.kv.cached_len, r.kv.device_len, r.spec.draft)
                                       for r in self.reqs]))
        return hashlib.sha1(desc.encode()).hexdigest()[:16]

    def to_worker_batch(self, vocab_size: int, base_seed: int, device: str,
                        fill_masks: MaskFiller | None = None) -> ModelWorkerBatch:
        ids: list[int] = []
        positions: list[int] = []
        logits_idx: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int] | None] = []
        prompt_targets: list[int] = []
        image_rows: list[ImageRows] = []
        image_floors: list[tuple[int, int, int]] = []
        for req, samples in zip(self.reqs, self.samples):
            fill = req.fill_ids
            if req.kv.future_token is not None:  # sampled by the batch in flight: resolved on the thread
                fill = fill + [req.kv.future_token]
            fill = fill + req.spec.draft
            kv, start = req.kv, len(ids)
            ids.extend(fill[kv.cached_len:kv.device_len])
            positions.extend(range(kv.cached_len, kv.device_len))
            if req.images:
                rows, floors = rows_in_pass(req.images, kv.cached_len, kv.device_len, start)
                image_rows.extend(rows)
                image_floors.extend(floors)
            # The prompt rows [lo, hi) this step computes, of those whose logprob was asked for.
            pstart = req.prompt_logprob_start
            lo = max(pstart or 0, kv.cached_len)
            hi = min(kv.device_len, len(req.origin_input_ids) - 1)
            if pstart is not None and hi > lo:
                prompt_rows.append((len(logits_idx), hi - lo))
                logits_idx.extend(start + p - kv.cached_len for p in range(lo, hi))
                prompt_targets.extend(fill[lo + 1:hi + 1])
            else:
                prompt_rows.append(None)
            sample_rows.extend(range(len(logits_idx), len(logits_idx) + samples))
            logits_idx.extend(range(len(ids) - samples, len(ids)))
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        fb = ForwardBatch(
            mode=self.mode, input_ids=t(ids), positions=t(positions),
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=t([r.kv.req_pool_idx for r in self.reqs]),
            prefix_lens=t([r.kv.cached_len for r in self.reqs]),
            extend_lens=t([r.kv.extend_len for r in self.reqs]), logits_indices=t(logits_idx),
            images=image_rows, image_key_floors=image_floors)
        rows = [(r, i) for r, s in zip(self.reqs, self.samples) for i in range(s)]
        sampling = build_sampling_info([r for r, _ in rows], vocab_size, base_seed, device,
                                       fill_masks, [i for _, i in rows])
        return ModelWorkerBatch(
            fb, sampling, t(sample_rows), prompt_rows, t(prompt_targets),
            max((r.logprobs.top_n for r in self.reqs if r.logprobs.return_logprob), default=0),
            any(r.logprobs.return_logprob for r in self.reqs))


def request_seed(req: Req, base_seed: int) -> int:
    """A request without a seed still gets a deterministic one, the same on every rank."""
    if req.sampling_params.seed is not None:
        # Clients may send any seed in [-2**63, 2**64): wrap it into int64 (the hash uses the low
        # 32 bits, which wrapping keeps), or building the seeds tensor kills the scheduler.
        return (req.sampling_params.seed + 2**63) % 2**64 - 2**63
    digest = hashlib.sha1(f"{base_seed}:{req.rid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


# Computes the next-token bitmask of each matcher, and after each token of its draft if it has one
# (GrammarBackend.fill_masks).
MaskFiller = Callable[[Sequence[GrammarMatcher], Sequence[Sequence[int]]], torch.Tensor]


def build_sampling_info(reqs: list[Req], vocab: int, base_seed: int, device: str,
                        fill_masks: MaskFiller | None = None,
                        offsets: Sequence[int] | None = None) -> SamplingBatchInfo:
    """One row per sampled token. `offsets[i]`: row i samples the token that many places after the
    request's next one (a verify pass's draft positions), so it reads what plain decoding would
    there: the noise of that step, penalties counting the draft tokens before it, the grammar's
    mask after them. `fill_masks` is None on ranks that do not sample (stages before the last)."""
    ps = [r.sampling_params for r in reqs]
    offsets = offsets or [0] * len(reqs)
    # the tokens generated before each row's position (draft tokens included)
    outputs = lambda: [r.output_ids + r.spec.draft[:o] for r, o in zip(reqs, offsets)]  # noqa: E731
    f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
    i = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    # top_k past the vocabulary is the same as off (and past int64 it would not fit the tensor).
    top_ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps]
    info = SamplingBatchInfo(
        temperatures=f([0.0 if p.is_greedy else p.temperature for p in ps]),
        top_ps=f([p.top_p for p in ps]), top_ks=i(top_ks), min_ps=f([p.min_p for p in ps]),
        seeds=i([request_seed(r, base_seed) for r in reqs]),
        steps=i([r.sampled_len + o for r, o in zip(reqs, offsets)]),
        all_greedy=all(p.is_greedy for p in ps),
        need_filter=any(p.top_p < 1 or k < vocab or p.min_p > 0 for p, k in zip(ps, top_ks)))
    if any(p.frequency_penalty or p.presence_penalty for p in ps):
        info.frequency_penalties = f([p.frequency_penalty for p in ps])
        info.presence_penalties = f([p.presence_penalty for p in ps])
        info.output_counts = counts_matrix(outputs(), vocab, device)
    if any(p.repetition_penalty != 1.0 for p in ps):
        info.repetition_penalties = f([p.repetition_penalty for p in ps])
        seen = [r.origin_input_ids + out for r, out in zip(reqs, outputs())]
        info.seen_mask = counts_matrix(seen, vocab, device) > 0
    biased = [(row, {int(t): b for t, b in p.logit_bias.items()}) for row, p in enumerate(ps)
              if p.logit_bias]
    if biased:
        info.logit_bias = [(row, i(list(bias)), f(list(bias.values()))) for row, bias in biased]
    rows = [i for i, r in enumerate(reqs) if r.sampling.grammar is not None]
    if rows and fill_masks is not None:
        # A request's rows are consecutive (offsets 0..k): its matcher fills them all, stepping
        # through the draft tokens that precede each.
        firsts = [i for i in rows if offsets[i] == 0]
        n_rows = Counter(id(reqs[i]) for i in rows)
        drafts = [reqs[i].spec.draft[:n_rows[id(reqs[i])] - 1] for i in firsts]
        info.vocab_mask = fill_masks([reqs[i].sampling.grammar for i in firsts], drafts).to(device)
        info.vocab_mask_rows = rows
    return info

"""Speculative decoding in the scheduler (--speculative-algorithm NGRAM): which decoding requests
draft this step, and what their verify passes accepted.

A request with a draft d_1..d_k extends by 1 + k positions (its last token, then the draft), each
sampled with the noise plain decoding would draw there (step + i); its tokens are taken in order
up to the first that differs from the draft (`OutputProcessor._take_tokens`). On a CPU every row's logits are
the bits a one-token decode step gives (row-wise linears and norms, one query row per attention
call), and each row's sampling reads what plain decoding's would there (penalties count the
draft tokens before it, a grammar's mask follows them: build_sampling_info), so tokens, logprobs
and finishes are bitwise those of plain decoding. A draft ends before the first token its
request's grammar forbids. In a batch of several (at most SPEC_MAX_BATCH), only requests whose
last draft was taken whole draft. Drafts are a pure function of the tokens and the batch: every
rank drafts alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lockstep.managers.ngram_drafter import NgramConfig, NgramDrafter
from lockstep.managers.schedule_batch import Req
from lockstep.multimodal.refs import is_pad_id
from lockstep.server_args import ServerArgs

# On a CPU a decode step's cost is its weight reads up to a few rows and its arithmetic beyond: a
# batch this large is compute-bound, where a draft's rows cost about what plain steps would.
SPEC_MAX_BATCH = 4
# Below it a draft row still costs arithmetic (the int8 head and layers) of the order of a request's
# share of a plain pass, so in a batch a draft pays only if most of it is accepted: requests on
# random text drafting what one alone would were slower than plain decoding. So with company a
# request drafts only while its drafts are taken whole, and first drafts FIRST_DRAFT_IN_COMPANY
# tokens to find out (each draft taken whole doubles the next: ngram_drafter), since first drafts
# of the full length still slowed such a batch. The figures: docs/benchmarks.md, "Speculation by
# default" (a single machine's runs, which every kernel change moves).
FIRST_DRAFT_IN_COMPANY = 2


@dataclass
class SpecStats:
    verify_passes: int = 0  # request-steps that verified a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0


class Speculator:
    def __init__(self, args: ServerArgs) -> None:
        self.drafter = NgramDrafter(NgramConfig(
            max_draft=args.speculative_num_draft_tokens,
            min_window=args.speculative_ngram_min_match_window_size,
            max_window=args.speculative_ngram_max_match_window_size,
            capacity=args.speculative_ngram_capacity))
        self.stats = SpecStats()

    def draft(self, running: list[Req], max_req_len: int,
              alloc: Callable[[int], torch.Tensor | None]) -> torch.Tensor | None:
        """Set each running request's draft for this step and return the KV slots of the step
        (1 + draft length per request, in order); None, and no drafts, if none was made or the
        pool could not hold them (a draft is never worth retracting a request for)."""
        company = len(running) > 1
        for req in running:
            req.spec.draft = (self._propose(req, max_req_len, company)
                              if len(running) <= SPEC_MAX_BATCH else [])
        drafted = sum(len(r.spec.draft) for r in running)
        loc = alloc(len(running) + drafted) if drafted else None
        if loc is None:
            for req in running:
                req.spec.draft = []
        return loc

    def _propose(self, req: Req, max_req_len: int, company: bool) -> list[int]:
        if req.spec.drafter is None:
            req.spec.drafter = self.drafter.new_state()
        state = req.spec.drafter
        if company:
            if state.drafted == 0:  # a first draft beside others: a short one, to find out
                state.length = min(state.length, FIRST_DRAFT_IN_COMPANY)
            elif not state.last_whole:
                return []
        p = req.sampling_params
        # Plain decoding would emit at most this many more tokens; this step emits 1 + the draft.
        left = min(p.max_new_tokens - len(req.output_ids), max_req_len - req.seq_len)
        draft = self.drafter.propose(state, req.fill_ids, left - 1)
        if req.images:  # an image's tokens are never sampled: a draft ends before the first
            draft = draft[:next((i for i, t in enumerate(draft) if is_pad_id(t)), len(draft))]
        if (grammar := req.sampling.grammar) is not None:  # a token it forbids ends the draft
            draft = draft[:grammar.valid_prefix(draft)]
        return draft

    def verified(self, req: Req, accepted: int) -> None:
        """A decode step of a request that drafts (or may: it has a drafter state) is done, and
        `accepted` of its draft's tokens were taken; the draft is spent."""
        drafted, req.spec.draft = len(req.spec.draft), []
        self.drafter.observe(req.spec.drafter, drafted, accepted)
        if not drafted:
            return
        self.stats.verify_passes += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted

    def finished(self, req: Req) -> None:
        if req.output_ids:
            self.drafter.finished(req.fill_ids)

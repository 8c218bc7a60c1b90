"""The scheduler's result half: take a batch's sampled tokens into its requests, decide which
finished, and queue the outputs the scheduler sends on.

`OutputProcessor` changes a request's outputs, its logprob record, its grammar and stop checker
(advanced by each token) and which of its computed KV is kept (`kv.cached_len`). What it may not
change itself (the scheduler's queues, the prefix tree, the KV pool) it asks of the scheduler
through `SchedulerQueues`, the whole of its interface to it."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

from lockstep.core import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    BaseFinishReason,
    TokenLogprob,
)
from lockstep.forward_batch import ForwardMode
from lockstep.managers.schedule_batch import Req, ReqPhase, ScheduleBatch
from lockstep.managers.speculative import Speculator
from lockstep.managers.tp_worker import GenerationBatchResult
from lockstep.messages import ReqOutput
from lockstep.multimodal.encoder_cache import EncoderStats


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # submitted
    prefill_tokens: int = 0  # actually computed in extend passes
    cached_tokens: int = 0
    retractions: int = 0
    generated_tokens: int = 0
    overlapped_steps: int = 0  # steps that processed a result while the next batch computed


class SchedulerQueues(Protocol):
    """What the output processor asks of the scheduler, in the order a request's result needs it."""

    def start_decoding(self, req: Req) -> None:
        """`req`'s prompt is done and it sampled its first token: from now on it decodes."""

    def cache_unfinished(self, req: Req) -> None:
        """Hand `req`'s computed prefix to the prefix tree now, so that others can share it."""

    def free_uncached(self, req: Req) -> None:
        """Free `req`'s KV slots past `kv.cached_len` (a draft's rejected positions)."""

    def finish(self, req: Req, reason: BaseFinishReason) -> None:
        """End `req`: out of every queue, its KV released, then `OutputProcessor.finished`."""


class OutputProcessor:
    def __init__(self, queues: SchedulerQueues, stats: SchedulerStats, eos_ids: frozenset[int],
                 max_req_len: int, speculator: Speculator | None, dp_rank: int = 0) -> None:
        self.queues = queues
        self.stats = stats
        self.eos_ids = eos_ids
        self.max_req_len = max_req_len
        self.speculator = speculator
        self.dp_rank = dp_rank  # which data-parallel replica this scheduler serves
        self.pending: list[ReqOutput] = []  # this step's outputs, in the order they happened
        self.encoder_stats: EncoderStats | None = None  # a model that reads images: its cache's

    def take_outputs(self) -> list[ReqOutput]:
        out, self.pending = self.pending, []
        return out

    def process_batch_result(self, batch: ScheduleBatch, res: GenerationBatchResult,
                             futures: list[int] | None = None) -> None:
        # j: the request's first row among the sampled ones
        for i, (req, j) in enumerate(zip(batch.reqs, accumulate(batch.samples, initial=0))):
            if batch.samples[i] and futures is not None and req.kv.future_token == futures[j]:
                req.kv.future_token = None  # no later batch of this request was launched yet
            # Finished already: aborted while the batch ran or, with overlap, finished by the
            # previous batch. Its token here is dropped; its KV was released then, once.
            if req.finished:
                continue
            if batch.mode != ForwardMode.DECODE:
                self.stats.prefill_tokens += batch.extend_lens[i]
            req.kv.cached_len = req.kv.device_len  # already so when an overlap launch moved it
            if res.prompt_logprobs and res.prompt_logprobs[i] is not None:
                self._add_prompt_logprobs(req, res, i)
            if not batch.samples[i]:
                self.queues.cache_unfinished(req)
                continue
            if req.sampling_params.max_new_tokens == 0:
                if res.embeddings is not None:
                    req.embedding = res.embeddings[i]
                self.queues.finish(req, FINISH_LENGTH(0))
                continue
            reason = self._take_tokens(req, res, j, batch.samples[i])
            if reason is not None:
                self.queues.finish(req, reason)
                continue
            if req.phase == ReqPhase.PREFILL:
                req.phase = ReqPhase.DECODE
                self.queues.cache_unfinished(req)
                self.queues.start_decoding(req)
            self._emit(req)

    def _take_tokens(self, req: Req, res: GenerationBatchResult, j: int, n: int
                     ) -> BaseFinishReason | None:
        """Append the request's sampled tokens res[j : j + n] in order, as plain decoding would
        have one step each, until one finishes it or, in a speculative verify pass (n = 1 + its
        draft's length), one differs from the draft token that the next position was computed
        from. Only the KV of accepted inputs is kept: the rest is freed, never reaching the tree."""
        start, draft, lp = req.kv.device_len - n, req.spec.draft, req.logprobs
        reason = None
        for s in range(n):
            req.kv.cached_len = start + s + 1  # the inputs up to this token's position were right
            token = res.next_token_ids[j + s]
            req.output_ids.append(token)
            self.stats.generated_tokens += 1
            if lp.return_logprob and res.next_token_logprobs is not None:
                lp.out.append(TokenLogprob(res.next_token_logprobs[j + s], token))
                if lp.top_n and res.next_top_logprobs is not None:
                    lp.out_top.append(_logprobs(res.next_top_logprobs[j + s][: lp.top_n]))
            reason = self._check_finished(req, token)
            if reason is not None or s == n - 1 or token != draft[s]:
                break
        if req.spec.drafter is not None and req.phase == ReqPhase.DECODE:  # a drafter's decode step
            assert self.speculator is not None
            self.speculator.verified(req, accepted=s)
        self.queues.free_uncached(req)
        return reason

    def _add_prompt_logprobs(self, req: Req, res: GenerationBatchResult, i: int) -> None:
        lp = req.logprobs
        if not lp.prompt and req.prompt_logprob_start is not None:
            lp.prompt.append(TokenLogprob(None, req.origin_input_ids[req.prompt_logprob_start]))
            if lp.top_n:
                lp.prompt_top.append([])
        lp.prompt.extend(_logprobs(res.prompt_logprobs[i]))
        if lp.top_n and res.prompt_top_logprobs[i]:
            lp.prompt_top.extend(_logprobs(t[: lp.top_n]) for t in res.prompt_top_logprobs[i])

    def _check_finished(self, req: Req, token: int) -> BaseFinishReason | None:
        p, grammar, stops = req.sampling_params, req.sampling.grammar, req.sampling.stops
        n = len(req.output_ids)
        if grammar is not None:
            if not grammar.accept(token):
                return FINISH_ABORT(f"the grammar rejected sampled token {token}: "
                                    f"{grammar.error}", status_code=500)
            if grammar.is_terminated:  # complete: nothing but an end token could follow
                return FINISH_MATCHED_TOKEN(token)
        if n >= p.min_new_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)):
            return FINISH_MATCHED_TOKEN(token)
        if stops is not None and (stop := stops.push(token)) is not None:
            return FINISH_MATCHED_STR(stop)
        if n >= p.max_new_tokens or req.seq_len >= self.max_req_len:
            return FINISH_LENGTH(n)
        return None

    def finished(self, req: Req, reason: BaseFinishReason) -> None:
        """The scheduler has taken `req` out of its queues and released its KV: record why it
        ended and queue its last output."""
        req.finish_reason = reason
        req.phase = ReqPhase.FINISHED
        self._emit(req)
        if self.speculator is not None:
            self.speculator.finished(req)

    def _emit(self, req: Req) -> None:
        new = req.output_ids[req.sent_len:]
        req.sent_len = len(req.output_ids)
        p, stops = req.sampling_params, req.sampling.stops
        out, out_top, prompt, prompt_top = req.logprobs.take()
        self.pending.append(ReqOutput(
            rid=req.rid, new_token_ids=new, finish_reason=req.finish_reason,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            output_token_logprobs=out, output_top_logprobs=out_top,
            input_token_logprobs=prompt, input_top_logprobs=prompt_top,
            dp_rank=self.dp_rank, embedding=req.embedding, text_limit=stops.text_limit(req.finished) if stops else None,
            decode_options=(p.skip_special_tokens, p.spaces_between_special_tokens),
            spec=(s.verify_ct, s.drafted, s.accepted) if (s := req.spec.drafter) else None,
            encoder=(e.runs, e.hits) if (e := self.encoder_stats) else None))


def _logprobs(pairs: list[tuple[float, int]]) -> list[TokenLogprob]:
    return [TokenLogprob(lp, tid) for lp, tid in pairs]

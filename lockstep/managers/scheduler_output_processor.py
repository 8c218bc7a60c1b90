"""The scheduler's result half (SGLang's SchedulerOutputProcessorMixin): take a batch's sampled
tokens into its requests, decide which finished, and queue the outputs the scheduler sends on.
`finish` is the one place a request ends, whatever ended it."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

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
from lockstep.managers.tp_worker import GenerationBatchResult
from lockstep.messages import ReqOutput


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # submitted
    prefill_tokens: int = 0  # actually computed in extend passes
    cached_tokens: int = 0
    retractions: int = 0
    generated_tokens: int = 0
    overlapped_steps: int = 0  # steps that processed a result while the next batch computed


class SchedulerOutputProcessorMixin:
    """Mixed into Scheduler, whose state (queues, tree, stats, pending outputs) it works on."""

    def process_batch_result(self, batch: ScheduleBatch, res: GenerationBatchResult,
                             futures: list[int] | None = None) -> None:
        # j: the request's first row among the sampled ones
        for i, (req, j) in enumerate(zip(batch.reqs, accumulate(batch.samples, initial=0))):
            if batch.samples[i] and futures is not None and req.future_token == futures[j]:
                req.future_token = None  # no later batch of this request was launched yet
            # Finished already: aborted while the batch ran or, with overlap, finished by the
            # previous batch. Its token here is dropped; its KV was released then, once.
            if req.finished:
                continue
            if batch.mode != ForwardMode.DECODE:
                self.stats.prefill_tokens += batch.extend_lens[i]
            req.cached_len = req.device_len  # already so when an overlap launch moved it
            if res.prompt_logprobs and res.prompt_logprobs[i] is not None:
                self._add_prompt_logprobs(req, res, i)
            if not batch.samples[i]:
                self._cache_unfinished(req)
                continue
            if req.sampling_params.max_new_tokens == 0:
                self.finish(req, FINISH_LENGTH(0))
                continue
            reason = self._take_tokens(req, res, j, batch.samples[i])
            if reason is not None:
                self.finish(req, reason)
                continue
            if req.phase == ReqPhase.PREFILL:
                req.phase = ReqPhase.DECODE
                self._cache_unfinished(req)
                self.running.append(req)
            self._emit(req)

    def _take_tokens(self, req: Req, res: GenerationBatchResult, j: int, n: int
                     ) -> BaseFinishReason | None:
        """Append the request's sampled tokens res[j : j + n] in order, as plain decoding would
        have one step each, until one finishes it or, in a speculative verify pass (n = 1 + its
        draft's length), one differs from the draft token that the next position was computed
        from. Only the KV of accepted inputs is kept: the rest is freed, never reaching the tree."""
        start, draft = req.device_len - n, req.draft
        req.draft = []
        reason = None
        for s in range(n):
            req.cached_len = start + s + 1  # the inputs up to this token's position were right
            token = res.next_token_ids[j + s]
            req.output_ids.append(token)
            self.stats.generated_tokens += 1
            if req.return_logprob and res.next_token_logprobs is not None:
                req.out_logprobs.append(TokenLogprob(res.next_token_logprobs[j + s], token))
                if req.top_logprobs_num and res.next_top_logprobs is not None:
                    req.out_top_logprobs.append(
                        _logprobs(res.next_top_logprobs[j + s][: req.top_logprobs_num]))
            reason = self._check_finished(req, token)
            if reason is not None or s == n - 1 or token != draft[s]:
                break
        if req.spec is not None and req.phase == ReqPhase.DECODE:  # a decode step of a drafter
            self.speculator.verified(req, len(draft), accepted=s)
        self._free_uncached(req)
        return reason

    def _add_prompt_logprobs(self, req: Req, res: GenerationBatchResult, i: int) -> None:
        if not req.in_logprobs and req.prompt_logprob_start is not None:
            start = req.prompt_logprob_start
            req.in_logprobs.append(TokenLogprob(None, req.origin_input_ids[start]))
            if req.top_logprobs_num:
                req.in_top_logprobs.append([])
        req.in_logprobs.extend(_logprobs(res.prompt_logprobs[i]))
        if req.top_logprobs_num and res.prompt_top_logprobs[i]:
            req.in_top_logprobs.extend(_logprobs(t[: req.top_logprobs_num])
                                       for t in res.prompt_top_logprobs[i])

    def _check_finished(self, req: Req, token: int) -> BaseFinishReason | None:
        p = req.sampling_params
        n = len(req.output_ids)
        if req.grammar is not None:
            if not req.grammar.accept(token):
                return FINISH_ABORT(f"the grammar rejected sampled token {token}: "
                                    f"{req.grammar.error}", status_code=500)
            if req.grammar.is_terminated:  # complete: nothing but an end token could follow
                return FINISH_MATCHED_TOKEN(token)
        if n >= p.min_new_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)):
            return FINISH_MATCHED_TOKEN(token)
        if req.stops is not None and (stop := req.stops.push(token)) is not None:
            return FINISH_MATCHED_STR(stop)
        if n >= p.max_new_tokens or req.seq_len >= self.max_req_len:
            return FINISH_LENGTH(n)
        return None

    def finish(self, req: Req, reason: BaseFinishReason) -> None:
        """End a request: out of every queue, its KV released, its last output queued."""
        self.waiting = [r for r in self.waiting if r is not req]
        self.running = [r for r in self.running if r is not req]
        if self.chunked_req is req:
            self.chunked_req = None
        self._release(req)
        req.finish_reason = reason
        req.phase = ReqPhase.FINISHED
        self._emit(req)
        if self.speculator is not None:
            self.speculator.finished(req)

    def _emit(self, req: Req) -> None:
        new = req.output_ids[req.sent_len:]
        req.sent_len = len(req.output_ids)
        p = req.sampling_params
        self._pending.append(ReqOutput(
            rid=req.rid, new_token_ids=new, finish_reason=req.finish_reason,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            output_token_logprobs=req.out_logprobs, output_top_logprobs=req.out_top_logprobs,
            input_token_logprobs=req.in_logprobs, input_top_logprobs=req.in_top_logprobs,
            dp_rank=self.dp_rank, text_limit=req.stops.text_limit(req.finished) if req.stops else None,
            decode_options=(p.skip_special_tokens, p.spaces_between_special_tokens),
            spec=req.spec and (req.spec.verify_ct, req.spec.drafted, req.spec.accepted)))
        req.out_logprobs, req.out_top_logprobs, req.in_logprobs, req.in_top_logprobs = [], [], [], []


def _logprobs(pairs: list[tuple[float, int]]) -> list[TokenLogprob]:
    return [TokenLogprob(lp, tid) for lp, tid in pairs]

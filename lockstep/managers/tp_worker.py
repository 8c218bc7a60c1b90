"""Runs one batch on this rank's model: forward, logits where needed, sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lockstep.distributed.communication import broadcast_pyobj
from lockstep.forward_batch import split_forward_batch
from lockstep.layers.sampler import sample
from lockstep.managers import pooling_step
from lockstep.managers.schedule_batch import ModelWorkerBatch
from lockstep.model_executor.model_runner import ModelRunner
from lockstep.model_loader.pooling import Pooling

# Prompt-logprob rows are turned into logits this many at a time: a 262k-wide row costs 1 MB.
PROMPT_LOGITS_SLICE = 64


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]
    next_token_logprobs: list[float] | None = None
    next_top_logprobs: list[list[tuple[float, int]]] | None = None
    # per request: list of (logprob, token) for its prompt rows, or None
    prompt_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[list[tuple[float, int]]] | None] = field(default_factory=list)
    # An embedding or scoring model's: per request, its pooled vector (or scores); no tokens.
    embeddings: list[list[float]] | None = None


class TpModelWorker:
    def __init__(self, runner: ModelRunner, micro_batches: int = 1,
                 pooling: Pooling | None = None) -> None:
        self.runner = runner
        self.pooling = pooling  # None: the model generates; else its last step pools
        # --pp-micro-batches (ServerArgs.micro_batches): slices of a batch the pipeline stages
        # work on at once. Every rank holds the same value, so every rank splits alike.
        self.micro_batches = micro_batches

    @torch.inference_mode()
    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        pp = self.runner.pp
        if self.pooling is not None:  # one stage (models/bert.py), every rank holds every row
            fb = batch.forward_batch
            pooling_step.all_rows(fb)
            hidden = self.runner.forward(fb)
            return GenerationBatchResult([], embeddings=pooling_step.pool(
                hidden, fb.extend_lens, self.pooling, self.runner.model))
        # The micro-batches of this step. The split depends only on the batch, never on this
        # rank, and the last stage samples the rows of all of them together with the whole
        # batch's sampling info, so tokens (logprobs, prompt logprobs) do not depend on it.
        parts = split_forward_batch(batch.forward_batch, self.micro_batches if pp.size > 1 else 1)
        hidden = self.runner.forward_micro_batches(parts)
        res = self._sample(hidden, batch) if pp.is_last else None
        if pp.size > 1:
            # The last stage's result reaches every rank, so all schedulers stay in step.
            res = broadcast_pyobj(res, pp.world, src=pp.last_stage_src)
        return res

    def _sample(self, hidden: torch.Tensor, batch: ModelWorkerBatch) -> GenerationBatchResult:
        model = self.runner.model
        res = GenerationBatchResult([])
        if batch.sample_rows.numel():
            logits = model.compute_logits(hidden[batch.sample_rows])
            out = sample(logits, batch.sampling, batch.top_logprobs_num, batch.return_logprob)
            res.next_token_ids = out.next_token_ids.tolist()
            if out.logprobs is not None:
                res.next_token_logprobs = out.logprobs.tolist()
            if out.top_logprobs is not None:
                res.next_top_logprobs = _pairs(out.top_logprobs, out.top_ids)
        if any(r is not None for r in batch.prompt_rows):
            self._prompt_logprobs(hidden, batch, res)
        return res

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: ModelWorkerBatch,
                         res: GenerationBatchResult) -> None:
        model = self.runner.model
        offset = 0
        for rows in batch.prompt_rows:
            if rows is None:
                res.prompt_logprobs.append(None)
                res.prompt_top_logprobs.append(None)
                continue
            start, count = rows
            lps: list[tuple[float, int]] = []
            tops: list[list[tuple[float, int]]] = []
            for s in range(0, count, PROMPT_LOGITS_SLICE):
                n = min(PROMPT_LOGITS_SLICE, count - s)
                logp = torch.log_softmax(model.compute_logits(hidden[start + s:start + s + n]), -1)
                targets = batch.prompt_targets[offset + s:offset + s + n]
                lps.extend(zip(logp.gather(1, targets[:, None]).squeeze(1).tolist(), targets.tolist()))
                if batch.top_logprobs_num:
                    vals, ids = logp.topk(batch.top_logprobs_num, dim=-1)
                    tops.extend(_pairs(vals, ids))
            offset += count
            res.prompt_logprobs.append(lps)
            res.prompt_top_logprobs.append(tops)


def _pairs(vals: torch.Tensor, ids: torch.Tensor) -> list[list[tuple[float, int]]]:
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]

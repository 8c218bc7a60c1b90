"""Drive a Scheduler inside the test process: the same scheduler the server runs, no sockets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from lockstep.core import BaseFinishReason, SamplingParams
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.managers.scheduler import Scheduler, create_scheduler
from lockstep.messages import TokenizedGenerateReq
from lockstep.server_args import ServerArgs


@dataclass
class Finished:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: BaseFinishReason | None = None
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    cached_tokens: int = 0


def make_scheduler(model_path: Any, **overrides: Any) -> Scheduler:
    """model_path None: the default model."""
    path = None if model_path is None else str(model_path)
    args = ServerArgs(model_path=path, dtype=overrides.pop("dtype", "float32"), **overrides)
    return create_scheduler(args, strict_integrity=True)


def greedy_req(rid: str, ids: list[int], max_new: int, **kw: Any) -> TokenizedGenerateReq:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    constraint = kw.pop("constraint", None)  # carried as the field of its kind (regex, ...)
    if constraint is not None:
        setattr(params, constraint.kind, constraint.text)
    for k in list(kw):
        if hasattr(params, k):
            setattr(params, k, kw.pop(k))
    return TokenizedGenerateReq(rid, list(ids), params, **kw)


def run_to_completion(sched: Scheduler, schedule: dict[int, list[Any]] | list[Any],
                      max_steps: int = 100_000) -> dict[str, Finished]:
    """Feed `schedule` (messages, or {step: messages}) and step until every request finishes."""
    timed = schedule if isinstance(schedule, dict) else {0: list(schedule)}
    results: dict[str, Finished] = {}
    last_input = max(timed) if timed else 0
    for step in range(max_steps):
        for out in sched.step(timed.get(step, [])):
            r = results.setdefault(out.rid, Finished())
            r.output_ids.extend(out.new_token_ids)
            r.logprobs.extend(e.logprob for e in out.output_token_logprobs)
            r.input_logprobs.extend(e.logprob for e in out.input_token_logprobs)
            r.cached_tokens = out.cached_tokens
            if out.finish_reason is not None:
                r.finish_reason = out.finish_reason
        if step >= last_input and sched.is_idle():
            sched.check_integrity()
            return results
    raise RuntimeError(f"requests still unfinished after {max_steps} steps")


def generate_through(launched: Any, prompts: list[list[int]], max_new: int,
                     concurrent: bool = True, return_logprob: bool = False) -> list[Any]:
    """Greedy-generate through a launched server's TokenizerManager (real processes, real ZMQ):
    each prompt's output ids, or with `return_logprob` (ids, their logprobs)."""
    tm = launched.tokenizer_manager

    async def one(prompt: list[int]) -> Any:
        req = GenerateReqInput(input_ids=prompt, return_logprob=return_logprob, sampling_params={
            "max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}).normalize()[0]
        async for out in tm.generate(req):
            pass
        if return_logprob:
            return out.output_ids, [lp.logprob for lp in out.output_token_logprobs or []]
        return out.output_ids

    async def main() -> list[Any]:
        if concurrent:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]

    return asyncio.run(main())

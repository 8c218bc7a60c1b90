"""Drive a Scheduler inside the test process: the same scheduler the server runs, no sockets."""

from __future__ import annotations

import asyncio
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from lockstep.constrained.backend import grammar_vocabulary
from lockstep.core import BaseFinishReason
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.managers.scheduler import ModelFiles, Scheduler, create_scheduler
from lockstep.messages import TokenizedGenerateReq
from lockstep.model_loader.packaged import PACKAGED_MODELS
from lockstep.model_loader.stop_tokens import stop_token_ids as _read_stop_token_ids
from lockstep.sampling_params import SamplingParams
from lockstep.server_args import ServerArgs


@dataclass
class Finished:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: BaseFinishReason | None = None
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    cached_tokens: int = 0
    spec: tuple[int, int, int] | None = None  # (verify passes, drafted, accepted), as meta_info's
    embedding: list[float] | None = None  # an embedding model's pooled vector


@functools.cache
def packaged_tokenizer(name: str) -> Any:
    """A packaged model's HF tokenizer (lockstep.model_loader.packaged), loaded once per test
    process: Gemma's 262k-entry tokenizer.json takes seconds to parse, and the files of a packaged
    model never change."""
    from transformers import AutoTokenizer

    from lockstep.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(name).model_dir))


@functools.cache
def _packaged_model_files(name: str) -> ModelFiles:
    """What every scheduler of a packaged model reads from its files besides the weights, read
    once per test process (the same objects each would build from the same files; each server
    process still reads its own). The grammar vocabulary is built when the first of them is made
    (seconds for the 262k vocabulary) and then shared: it is read-only."""
    from lockstep.configs.model_config import ModelConfig
    from lockstep.model_loader import resolve_model

    source = resolve_model(name)
    cfg = ModelConfig.from_hf(source.hf_config)
    stop_ids = _read_stop_token_ids(source.model_dir, cfg.eos_token_ids)
    tokenizer = packaged_tokenizer(name)
    vocabulary = functools.cache(lambda: grammar_vocabulary(tokenizer, cfg.vocab_size, stop_ids))
    return ModelFiles(tokenizer, stop_ids, vocabulary)


def make_scheduler(model_path: str | os.PathLike[str], **overrides: Any) -> Scheduler:
    """A packaged model by name (its tokenizer read once per process: tests name GEMMA, never
    the default), or a path."""
    args = ServerArgs(model_path=str(model_path), dtype=overrides.pop("dtype", "float32"),
                      **overrides)
    packaged = args.model_path in PACKAGED_MODELS and args.tokenizer_path is None
    return create_scheduler(args, strict_integrity=True,
                            files=_packaged_model_files(args.model_path) if packaged else None)


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
            r.spec = out.spec
            r.embedding = out.embedding if out.embedding is not None else r.embedding
            if out.finish_reason is not None:
                r.finish_reason = out.finish_reason
        if step >= last_input and sched.is_idle():
            sched.check_integrity()
            return results
    raise RuntimeError(f"requests still unfinished after {max_steps} steps")


def generate_through(launched: Any, prompts: list[list[int]], max_new: int,
                     concurrent: bool = True, return_logprob: bool = False,
                     sampling: list[dict[str, Any]] | None = None) -> list[Any]:
    """Greedy-generate through a launched server's TokenizerManager (real processes, real ZMQ):
    each prompt's output ids, or with `return_logprob` (ids, their logprobs). `sampling`: more
    sampling params per prompt (a regex, penalties). Once per launch: the manager's sockets
    belong to the event loop of its first call."""
    tm = launched.tokenizer_manager

    async def one(prompt: list[int], more: dict[str, Any]) -> Any:
        req = GenerateReqInput(input_ids=prompt, return_logprob=return_logprob, sampling_params={
            "max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True, **more}).normalize()[0]
        async for o in tm.generate(req):
            out = o
        if return_logprob:
            return out.output_ids, [lp.logprob for lp in out.output_token_logprobs or []]
        return out.output_ids

    mores = sampling or [{}] * len(prompts)

    async def main() -> list[Any]:
        if concurrent:
            return list(await asyncio.gather(*(one(p, m) for p, m in zip(prompts, mores))))
        return [await one(p, m) for p, m in zip(prompts, mores)]

    return asyncio.run(main())

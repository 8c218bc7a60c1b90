"""Drive a Scheduler inside the test process: the same scheduler the server runs, no sockets."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lockstep.constrained.backend import GrammarBackend
from lockstep.core import BaseFinishReason, SamplingParams
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.managers.scheduler import Scheduler, create_scheduler
from lockstep.messages import TokenizedGenerateReq
from lockstep.model_loader.stop_tokens import stop_token_ids as _read_stop_token_ids
from lockstep.server_args import ServerArgs


@dataclass
class Finished:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: BaseFinishReason | None = None
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    cached_tokens: int = 0


@functools.cache
def default_tokenizer() -> Any:
    """The default model's HF tokenizer, loaded once per test process: its 262k-entry
    tokenizer.json takes seconds to parse, and the default model's files never change."""
    from transformers import AutoTokenizer

    from lockstep.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None).model_dir))


@functools.cache
def _default_stop_token_ids(eos_token_ids: tuple[int, ...]) -> list[int]:
    from lockstep.model_loader import resolve_model

    return _read_stop_token_ids(resolve_model(None).model_dir, eos_token_ids)


_LLG_TOKENIZERS: dict[tuple[int, tuple[int, ...]], Any] = {}


class _SharedVocabularyBackend(GrammarBackend):
    """A default-model scheduler's grammar backend whose llguidance tokenizer (built on the first
    constrained request, ~5 s for the 262k vocabulary) is shared by every such backend of the
    process: it is read-only, built from the same (shared) HF tokenizer, vocabulary size and EOS
    ids. Everything else (the compiled grammars, the matchers) stays the backend's own."""

    @property
    def tokenizer(self) -> Any:
        key = (self.model_vocab_size, tuple(self.eos_token_ids))
        if key not in _LLG_TOKENIZERS:
            _LLG_TOKENIZERS[key] = GrammarBackend.tokenizer.fget(self)  # type: ignore[attr-defined]
        self._tokenizer = _LLG_TOKENIZERS[key]
        return self._tokenizer


@contextlib.contextmanager
def _default_model_files_read_once(args: ServerArgs) -> Iterator[None]:
    """While a scheduler of the default model is built in this process, its tokenizer, stop ids
    and grammar vocabulary come from the first such build (the same objects every scheduler
    would read from the same files; each server process still loads its own). Any other model
    loads as it would."""
    if args.model_path is not None or args.tokenizer_path is not None:
        yield
        return
    from unittest import mock

    from lockstep.detokenizer import incremental_detokenizer
    from lockstep.managers import scheduler
    from lockstep.model_loader import stop_tokens

    def stop_ids(_model_dir: Any, eos_token_ids: Any) -> list[int]:
        return list(_default_stop_token_ids(tuple(eos_token_ids)))

    real_backend_for = scheduler.grammar_backend_for

    def backend_for(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Any) -> Any:
        backend = real_backend_for(hf_tokenizer, vocab_size, eos_token_ids)
        if backend is not None:
            backend.__class__ = _SharedVocabularyBackend
        return backend

    with mock.patch.object(incremental_detokenizer, "load_tokenizer",
                           lambda _args: default_tokenizer()), \
            mock.patch.object(stop_tokens, "stop_token_ids", stop_ids), \
            mock.patch.object(scheduler, "grammar_backend_for", backend_for):
        yield


def make_scheduler(model_path: Any, **overrides: Any) -> Scheduler:
    """model_path None: the default model (its tokenizer read once per process)."""
    path = None if model_path is None else str(model_path)
    args = ServerArgs(model_path=path, dtype=overrides.pop("dtype", "float32"), **overrides)
    with _default_model_files_read_once(args):
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
        async for o in tm.generate(req):
            out = o
        if return_logprob:
            return out.output_ids, [lp.logprob for lp in out.output_token_logprobs or []]
        return out.output_ids

    async def main() -> list[Any]:
        if concurrent:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]

    return asyncio.run(main())

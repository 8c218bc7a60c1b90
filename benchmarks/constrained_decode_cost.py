"""Per-output-token cost of a constrained request against an unconstrained one, batch 1, on the
default model with the server's default arguments (in-process scheduler, plain loop).

    python benchmarks/constrained_decode_cost.py [TOKENS] [ROUNDS]

Each round runs the same prompt unconstrained (ignore_eos) and under each constraint, every
one forced to exactly TOKENS tokens (max_new_tokens, and grammars that cannot end sooner), and
times the decode steps (prefill excluded). The median round is reported, with the time the
grammar work itself took per token (mask fill, mask application, accepting the token), which a
shared machine's load disturbs far less than whole steps.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import lockstep.layers.sampler as sampler_mod
from lockstep.constrained.backend import GrammarBackend, GrammarMatcher
from lockstep.constrained.constraint import Constraint
from lockstep.managers.scheduler import create_scheduler
from lockstep.messages import TokenizedGenerateReq
from lockstep.model_loader import resolve_model
from lockstep.sampling_params import SamplingParams
from lockstep.server_args import ServerArgs

PROMPT = "Write a long story about a dragon who learns to cook:"
CASES: dict[str, Constraint | None] = {
    "unconstrained": None,
    "regex [a-z ,.]+": Constraint("regex", "[a-z ,.]{2000}"),
    "json_schema (long string field)": Constraint("json_schema", json.dumps({
        "type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
        "required": ["story"]})),
    "ebnf (words)": Constraint("ebnf", 'root ::= word (" " word)*\nword ::= [a-z]+'),
}


GRAMMAR_SECONDS = [0.0]


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            GRAMMAR_SECONDS[0] += time.perf_counter() - t0
    return wrapper


def decode_time(sched, ids: list[int], constraint: Constraint | None, tokens: int, rid: str) -> float:
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True,
                            **({constraint.kind: constraint.text} if constraint else {}))
    sched.step([TokenizedGenerateReq(rid, ids, params)])  # prefill + first token, or
    while sched.grammar_queue:  # its grammar compiling off the loop, then prefill + first token
        sched.step()
    GRAMMAR_SECONDS[0] = 0.0
    t0 = time.perf_counter()
    steps = 0
    while not sched.is_idle():
        outs = sched.step()
        steps += 1
        if any(o.finish_reason is not None and o.finish_reason.type != "length" for o in outs):
            raise RuntimeError(f"{rid} ended early: {outs[-1].finish_reason}")
    return (time.perf_counter() - t0) / steps, GRAMMAR_SECONDS[0] / steps


def main() -> None:
    from transformers import AutoTokenizer

    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 48
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    GrammarBackend.fill_masks = timed(GrammarBackend.fill_masks)
    GrammarMatcher.accept = timed(GrammarMatcher.accept)
    sampler_mod.apply_vocab_mask_ = timed(sampler_mod.apply_vocab_mask_)
    sched = create_scheduler(ServerArgs(disable_radix_cache=True))
    ids = AutoTokenizer.from_pretrained(str(resolve_model(None).model_dir)).encode(PROMPT)
    for name, c in CASES.items():  # warm-up: the grammar tokenizer, compiled grammars, kernels
        decode_time(sched, ids, c, 4, f"warm-{name}")
    per: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    for r in range(rounds):
        for name, c in CASES.items():
            per[name].append(decode_time(sched, ids, c, tokens, f"{name}-{r}"))
    base = statistics.median(t for t, _ in per["unconstrained"])
    print("| request | ms / output token | vs unconstrained | grammar work ms / token |")
    print("|---|---|---|---|")
    for name, xs in per.items():
        med = statistics.median(t for t, _ in xs)
        work = statistics.median(g for _, g in xs)
        print(f"| {name} | {med * 1e3:.2f} | {med / base:.3f}x | {work * 1e3:.2f} |")


if __name__ == "__main__":
    main()

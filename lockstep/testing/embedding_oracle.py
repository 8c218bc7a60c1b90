"""Shared by the embedding tests and the benchmark: sentences of varied length from the built-in
corpus, and vectors of an in-process scheduler (the serving path's scheduler and model runner,
without the HTTP front) for a list of token-id prompts."""

from __future__ import annotations

import random
from typing import Any

from lockstep.messages import TokenizedGenerateReq
from lockstep.sampling_params import SamplingParams
from lockstep.testing.corpus import corpus_sentences, random_prompt
from lockstep.testing.inproc import run_to_completion


def sentences(n: int, seed: int = 0, min_words: int = 3, max_words: int = 90,
              lines: int = 100) -> list[str]:
    """Up to `lines` of the corpus's lines, then runs of `min_words`..`max_words` corpus words,
    `n` in all."""
    rng = random.Random(seed)
    lines = corpus_sentences()[:min(n, lines)]
    return lines + [random_prompt(rng, rng.randint(min_words, max_words)) for _ in range(n - len(lines))]


def embed_in_process(sched: Any, prompts: list[list[int]], prefix: str = "e") -> list[list[float]]:
    """Each prompt's pooled vector through `sched` (lockstep.testing.inproc.make_scheduler), all
    submitted at once, so they are batched as the scheduler decides."""
    reqs = [TokenizedGenerateReq(f"{prefix}{i}", ids, SamplingParams(max_new_tokens=0))
            for i, ids in enumerate(prompts)]
    res = run_to_completion(sched, reqs)
    return [res[f"{prefix}{i}"].embedding for i in range(len(prompts))]

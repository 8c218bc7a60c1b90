"""A prefix-cache hit changes no bit: a prompt served over a cached prefix (all of it but the last
token, or part of it) gives the same ids and logprobs as the same prompt prefilled fresh, greedy and
seeded, on the real model. On a CPU every query row runs alone in the decode kernel, so how many rows
a request extends by never changes a row's arithmetic; speculative verification builds on this."""

from __future__ import annotations

import random
from typing import Any

import pytest

from lockstep.testing.corpus import random_prompt
from lockstep.testing.inproc import (
    greedy_req,
    make_scheduler,
    packaged_tokenizer,
    run_to_completion,
)
from lockstep.testing.live_server import GEMMA

pytestmark = pytest.mark.real_model


def _prompts(n: int) -> list[list[int]]:
    tok = packaged_tokenizer(GEMMA)
    rng = random.Random(7)
    return [tok(random_prompt(rng, rng.randint(40, 70))).input_ids for _ in range(n)]


@pytest.fixture(scope="module")
def schedulers() -> tuple[Any, Any]:
    """(no radix cache, radix cache): shared by the greedy and the seeded case; the second's tree
    is emptied before each case, so each starts from a fresh scheduler's state."""
    return (make_scheduler(GEMMA, max_total_tokens=4096, disable_radix_cache=True),
            make_scheduler(GEMMA, max_total_tokens=4096))


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_cached_prefix_gives_the_bits_of_a_fresh_prefill(seeded: bool, schedulers) -> None:
    prompts = _prompts(3)
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 11} if seeded else {}
    fresh_sched, sched = schedulers
    fresh = run_to_completion(fresh_sched, [
        greedy_req(f"f{i}", p, 12, return_logprob=True, **sampling) for i, p in enumerate(prompts)])

    assert sched.flush_cache().success and sched.tree.total_size() == 0
    # Warm the tree: the whole prompt of the first (so the second pass extends by one row), the
    # first half of the second, a prefix plus unrelated tokens of the third.
    warm = [prompts[0], prompts[1][: len(prompts[1]) // 2], prompts[2][:17] + [235, 236, 237]]
    run_to_completion(sched, [greedy_req(f"w{i}", p, 1) for i, p in enumerate(warm)])
    cached = run_to_completion(sched, [
        greedy_req(f"c{i}", p, 12, return_logprob=True, **sampling) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert cached[f"c{i}"].cached_tokens > 0, "the prompt was not served over the tree"
        assert cached[f"c{i}"].output_ids == fresh[f"f{i}"].output_ids
        assert cached[f"c{i}"].logprobs == fresh[f"f{i}"].logprobs  # bitwise: float equality

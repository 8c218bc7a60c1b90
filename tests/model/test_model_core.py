"""The model core against HF transformers: same weights, same greedy tokens, close logprobs,
whatever the batch, prefix cache or chunking around a request."""

from __future__ import annotations

import pytest

from lockstep.model_loader.packaged import DEFAULT_MODEL
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.live_server import GEMMA
from lockstep.testing.oracle import hf_greedy, hf_prompt_logprobs
from lockstep.testing.tiny_models import TINY_ARCHS, tiny_prompts

MAX_NEW = 32


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_and_logprobs_match_hf(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    prompts = tiny_prompts(model_dir, 4, seed=1)
    # Longer than the tiny Gemma's 32-token sliding window.
    prompts[0] = tiny_prompts(model_dir, 1, seed=9, min_words=45, max_words=50)[0]
    assert len(prompts[0]) > 40
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    sched = make_scheduler(model_dir, max_total_tokens=4096)
    reqs = [greedy_req(f"r{i}", p, MAX_NEW, return_logprob=True) for i, p in enumerate(prompts)]
    got = run_to_completion(sched, reqs)
    for i, r in enumerate(ref):
        assert got[f"r{i}"].output_ids == r.output_ids, f"{arch} prompt {i}"
        assert got[f"r{i}"].logprobs == pytest.approx(r.logprobs, abs=1e-3)
    assert len({t for r in ref for t in r.output_ids}) >= 5, "degenerate oracle output proves nothing"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prompt_logprobs_match_hf(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    prompt = (tiny_prompts(model_dir, 1, seed=3)[0] * 5)[:70]
    ref = hf_prompt_logprobs(model_dir, prompt)
    sched = make_scheduler(model_dir, max_total_tokens=2048, chunked_prefill_size=32)
    got = run_to_completion(sched, [greedy_req("p", prompt, 1, return_logprob=True, logprob_start_len=0)])
    assert got["p"].input_logprobs[0] is None
    assert got["p"].input_logprobs[1:] == pytest.approx(ref, abs=1e-3)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_same_tokens_alone_batched_prefixed_and_chunked(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    prompts = tiny_prompts(model_dir, 16, seed=2, min_words=2, max_words=60)
    target = prompts[5]
    alone = run_to_completion(make_scheduler(model_dir, max_total_tokens=8192),
                              [greedy_req("t", target, MAX_NEW)])["t"].output_ids

    batched = run_to_completion(
        make_scheduler(model_dir, max_total_tokens=8192),
        [greedy_req(f"b{i}", p, MAX_NEW) for i, p in enumerate(prompts)])
    assert batched["b5"].output_ids == alone

    # Prefix already in KV: a first request leaves the prompt's head in the radix tree.
    sched = make_scheduler(model_dir, max_total_tokens=8192)
    run_to_completion(sched, [greedy_req("warm", target[: len(target) // 2 + 1], 4)])
    extended = run_to_completion(sched, [greedy_req("t", target, MAX_NEW)])["t"]
    assert extended.cached_tokens > 0
    assert extended.output_ids == alone

    chunked = run_to_completion(make_scheduler(model_dir, max_total_tokens=8192, chunked_prefill_size=7),
                                [greedy_req("t", target, MAX_NEW)])["t"]
    assert chunked.output_ids == alone


REAL_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: What is 17 + 25?\nAnswer:",
]


@pytest.fixture(scope="module", params=[GEMMA, DEFAULT_MODEL])
def real_model(request):
    """Both packaged models: Gemma 3 (gemma3) and the default, SmolLM2-135M-Instruct (llama)."""
    from transformers import AutoTokenizer

    from lockstep.model_loader import resolve_model

    source = resolve_model(request.param)
    tok = AutoTokenizer.from_pretrained(source.model_dir)
    return request.param, source.model_dir, [tok(p).input_ids for p in REAL_PROMPTS]


@pytest.mark.real_model
def test_real_packaged_models_match_hf_on_the_exact_path(real_model):
    name, model_dir, prompts = real_model
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    sched = make_scheduler(name, max_total_tokens=4096, int8_activations=False)  # float32 path
    got = run_to_completion(sched, [greedy_req(f"r{i}", p, MAX_NEW, return_logprob=True)
                                    for i, p in enumerate(prompts)])
    for i, r in enumerate(ref):
        assert got[f"r{i}"].output_ids == r.output_ids, f"prompt {i}"
        assert got[f"r{i}"].logprobs == pytest.approx(r.logprobs, abs=1e-3)

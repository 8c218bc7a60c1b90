"""Speculative decoding changes no output: with --speculative-algorithm NGRAM the ids, logprobs and
finish reasons are bitwise those of plain decoding, greedy and seeded, with every feature that
bears on which token comes next or when a request ends; rejected drafts leak no KV (the schedulers
here check the pool at every idle step and raise on a leak). Tiny models run on the block kernels
(--quantization q8_0), whose rows never depend on their batch, like the real model's GGUF blocks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from lockstep.core import FINISH_MATCHED_STR
from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import generate_through, greedy_req, make_scheduler, run_to_completion
from lockstep.testing.live_server import GEMMA

SPEC = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
OFF = {"speculative_algorithm": "NONE"}


def _prompts(n: int, seed: int = 0, length: int = 24) -> list[list[int]]:
    """Prompts that repeat themselves in part, as the text speculation is for does."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(5, 250) for _ in range(length)]
        out.append(base + base[: length // 2])
    return out


def _pair(model_dir: Any, **server: Any) -> tuple[Any, Any]:
    """Two schedulers of one model and settings, speculation off and on. Reused across runs: a
    prefix-cache hit changes no bit either (tests/scheduler/test_prefix_cache_bitwise.py)."""
    kw = {"max_total_tokens": 4096, "quantization": "q8_0", **server}
    return make_scheduler(model_dir, **kw, **OFF), make_scheduler(model_dir, **kw, **SPEC)


@pytest.fixture(scope="module")
def pairs(tiny_model_dirs) -> Any:
    made: dict[tuple, tuple[Any, Any]] = {}

    def get(arch: str, **server: Any) -> tuple[Any, Any]:
        key = (arch, tuple(sorted(server.items())))
        if key not in made:
            made[key] = _pair(tiny_model_dirs[arch], **server)
        return made[key]
    return get


def _compare(pair: tuple[Any, Any], reqs: Any) -> Any:
    """Run the same requests through both; their outputs must be bitwise equal. -> the spec one."""
    off, on = pair
    before = on.speculator.stats.verify_passes
    a, b = run_to_completion(off, reqs()), run_to_completion(on, reqs())
    assert a.keys() == b.keys()
    for rid in a:
        assert b[rid].output_ids == a[rid].output_ids, rid
        assert b[rid].logprobs == a[rid].logprobs, rid  # bitwise: float equality
        assert b[rid].finish_reason == a[rid].finish_reason, rid
    return b, on.speculator.stats.verify_passes - before


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.6, "top_p": 0.9, "seed": 3}],
                         ids=["greedy", "seeded"])
def test_spec_on_gives_the_bits_of_spec_off(arch: str, sampling: dict, pairs) -> None:
    reqs = lambda: [greedy_req(f"r{i}", p, 40, return_logprob=True, top_logprobs_num=3, **sampling)  # noqa: E731
                    for i, p in enumerate(_prompts(4, seed=1))]
    _, verified = _compare(pairs(arch), reqs)
    assert verified > 0  # drafts were made and verified


def test_speculation_is_on_by_default_on_a_cpu_and_off_where_asked(tiny_model_dirs) -> None:
    import argparse

    def parsed(*argv: str) -> ServerArgs:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        return ServerArgs.from_cli_args(parser.parse_args(list(argv)))

    assert parsed().speculation == "NGRAM"
    assert parsed("--speculative-algorithm", "NONE").speculation is None
    assert parsed("--disable-speculative-decoding").speculation is None
    assert parsed("--enable-overlap-schedule").speculation is None  # the overlap loop asked for
    assert parsed("--device", "cuda").speculation is None
    assert parsed("--device", "cuda", "--speculative-algorithm", "NGRAM").speculation == "NGRAM"
    model_dir = tiny_model_dirs["llama"]
    assert make_scheduler(model_dir, quantization="q8_0").speculator is not None
    assert make_scheduler(model_dir, quantization="q8_0", **OFF).speculator is None


def test_with_company_only_drafts_taken_whole_draft_again(pairs) -> None:
    """Alone a request drafts whatever its acceptance (the drafter shortens and pauses it); in a
    batch of several it drafts a short draft first, then only while its drafts are accepted whole
    (each one twice as long): there a draft row costs nearly what a plain step does."""
    from lockstep.managers.schedule_batch import Req
    from lockstep.managers.speculative import FIRST_DRAFT_IN_COMPANY

    sched = pairs("llama")[1]
    spec = sched.speculator
    text = [5, 6, 7, 8, 9] * 4  # repeats: always something to draft
    reqs = [Req(f"g{i}", list(text), greedy_req("x", [1], 64).sampling_params) for i in range(3)]
    alloc = lambda n: torch.arange(n)  # noqa: E731  (slots are not the point here)
    assert spec.draft(reqs, 4096, alloc) is not None
    assert [len(r.spec.draft) for r in reqs] == [FIRST_DRAFT_IN_COMPANY] * 3  # a short one, to find out
    spec.drafter.observe(reqs[0].spec.drafter, len(reqs[0].spec.draft), len(reqs[0].spec.draft))  # taken whole
    spec.drafter.observe(reqs[1].spec.drafter, len(reqs[1].spec.draft), 1)  # partly
    spec.drafter.observe(reqs[2].spec.drafter, len(reqs[2].spec.draft), 0)  # not at all
    spec.draft(reqs, 4096, alloc)
    assert [len(r.spec.draft) for r in reqs] == [2 * FIRST_DRAFT_IN_COMPANY, 0, 0]
    spec.draft(reqs[1:2], 4096, alloc)  # alone again: it drafts
    assert reqs[1].spec.draft


def test_a_draft_ends_before_the_first_token_the_grammar_forbids(pairs) -> None:
    from lockstep.constrained.constraint import constraint_from_fields
    from lockstep.managers.schedule_batch import Req, SamplingState

    sched = pairs("llama")[1]
    tok = sched.grammar.hf_tokenizer
    a, b, x = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "x"))
    matcher = sched.grammar.matcher(constraint_from_fields(r"(ab){1,3}x?", None, None))
    # the text so far repeats "a b x": the drafter proposes b x a b ..., the grammar allows b x
    req = Req("g", [a, b, x, a, b, x, a], greedy_req("x", [1], 64).sampling_params,
              sampling=SamplingState(grammar=matcher))
    assert matcher.accept(a)
    sched.speculator.draft([req], 4096, lambda n: torch.arange(n))
    assert req.spec.draft == [b, x]
    assert matcher.valid_prefix([b, a, b, a, b, a]) == 5  # (ab){1,3}: three "a b" in all, no fourth "a"


def test_fill_masks_gives_each_draft_token_its_own_row_and_consumes_nothing(pairs) -> None:
    from lockstep.constrained.constraint import constraint_from_fields

    backend = pairs("llama")[1].grammar
    tok = backend.hf_tokenizer
    a, b, c, d = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "d"))
    grammar = constraint_from_fields(r"(ab|cd){2,6}", None, None)
    first, plain, third = (backend.matcher(grammar) for _ in range(3))
    assert first.accept(a) and third.accept(c)
    # drafting, plain, drafting: rows are [first, first+b, first+b+c, plain, third, third+d]
    mask = backend.fill_masks([first, plain, third], [[b, c], [], [d]])

    def alone(prefix: list[int]) -> torch.Tensor:
        m = backend.matcher(grammar)
        assert all(m.accept(t) for t in prefix)
        return backend.fill_masks([m])[0]

    expected = [alone([a]), alone([a, b]), alone([a, b, c]), alone([]), alone([c]), alone([c, d])]
    assert mask.shape[0] == len(expected)
    for row, want in zip(mask, expected):
        assert torch.equal(row, want)
    assert len({tuple(r.tolist()) for r in expected}) > 2  # the rows differ: the test sees a wrong order
    # the matchers are where they were: the draft went through copies
    assert torch.equal(backend.fill_masks([first])[0], expected[0])
    assert torch.equal(backend.fill_masks([third])[0], expected[4])


SERVER_CASES = {
    "chunked": {"chunked_prefill_size": 8},
    "retraction": {"max_total_tokens": 160, "new_token_ratio": 0.05},  # admits what will not fit
    "mixed": {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
}


@pytest.mark.parametrize("case", ["stops", "penalties", "grammar", "beside_plain", "prefix_hit",
                                  *SERVER_CASES])
def test_features_behave_as_without_speculation(case: str, pairs) -> None:
    from lockstep.constrained.constraint import constraint_from_fields

    prompts = _prompts(4, seed=2)  # at most SPEC_MAX_BATCH: every decode batch may draft
    per_req: dict[str, Any] = {}
    if case == "stops":  # stop ids, min_new_tokens and max_new_tokens cut runs short
        per_req = {"stop_token_ids": [17, 42, 99], "min_new_tokens": 3, "ignore_eos": False}
    elif case == "penalties":
        per_req = {"frequency_penalty": 0.5, "repetition_penalty": 1.2}
    elif case in ("grammar", "beside_plain"):
        per_req = {"constraint": constraint_from_fields(r"(ab|cd){3,12}", None, None)}
    if case == "beside_plain":  # grammar and penalties on the even requests only: rows of both kinds
        per_req |= {"frequency_penalty": 0.5, "presence_penalty": 0.3}
    featured = lambda i: case != "beside_plain" or i % 2 == 0  # noqa: E731

    def reqs() -> dict:
        # Arriving a few steps apart, each drafts alone at first, then beside the others (with
        # company only drafts taken whole go on). The same prompts come again once the first
        # are done: their drafts, from the n-gram store, are taken, and meet every feature.
        waves = [[greedy_req(f"{w}{i}", p, 60, return_logprob=True, **(per_req if featured(i) else {}))
                  for i, p in enumerate(prompts)] for w in ("r", "again")]
        return {100 * w + 12 * i: [r] for w, wave in enumerate(waves) for i, r in enumerate(wave)}

    pair = pairs("llama", **SERVER_CASES.get(case, {}))
    accepted = pair[1].speculator.stats.accepted_tokens
    on, verified = _compare(pair, reqs)
    accepted = pair[1].speculator.stats.accepted_tokens - accepted
    assert verified > 0 and accepted > 0  # drafts were made, and some taken
    if case == "retraction":
        assert pair[1].stats.retractions > 0
    if case == "beside_plain":  # both kinds had drafts taken
        for kind in (0, 1):
            assert sum(r.spec[2] for rid, r in on.items() if int(rid[-1]) % 2 == kind) > 0
    if case == "prefix_hit":  # no other feature: the second wave's prompts are in the tree
        assert all(on[f"again{i}"].cached_tokens > 0 for i in range(len(prompts)))


@pytest.fixture(scope="module")
def real_pair() -> tuple[Any, Any]:
    """Gemma 3 270M's pair, speculation off and on, shared by the greedy and seeded case."""
    return (make_scheduler(GEMMA, max_total_tokens=4096, **OFF),
            make_scheduler(GEMMA, max_total_tokens=4096, **SPEC))


@pytest.mark.real_model
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "seed": 9}], ids=["greedy", "seeded"])
def test_the_real_model_copies_faster_with_the_same_bits(sampling: dict, real_pair) -> None:
    from lockstep.constrained.constraint import constraint_from_fields
    from lockstep.testing.corpus import _ENGLISH
    from lockstep.testing.inproc import packaged_tokenizer

    tok = packaged_tokenizer(GEMMA)
    passage = " ".join(_ENGLISH.splitlines()[3:8])
    ask = lambda task: tok(f"<start_of_turn>user\n{task}:\n\n{passage}<end_of_turn>\n"  # noqa: E731
                           "<start_of_turn>model\n").input_ids
    ids = ask("Repeat this text exactly")
    req = lambda **kw: greedy_req("r", kw.pop("ids", ids), 80, return_logprob=True,  # noqa: E731
                                  top_logprobs_num=2, **sampling, **kw)
    pair = real_pair
    for sched in pair:  # each case starts from an empty tree, as a fresh pair would
        assert sched.flush_cache().success
    accepted_before = pair[1].speculator.stats.accepted_tokens
    off, _ = _compare(pair, lambda: [req()])
    assert pair[1].speculator.stats.accepted_tokens - accepted_before > 10
    # A stop string inside an accepted run ends the request at the same token as without.
    text = tok.decode(off["r"].output_ids[20:30])
    stop = text.strip().split(" ")[0] if text.strip() else text
    on, _ = _compare(pair, lambda: [req(stop=[stop])])
    assert isinstance(on["r"].finish_reason, FINISH_MATCHED_STR)
    # Extraction under a JSON schema: the drafts copy the passage through the grammar's masks.
    schema = '{"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}'
    accepted_before = pair[1].speculator.stats.accepted_tokens
    on, _ = _compare(pair, lambda: [req(ids=ask("Copy this text into JSON"),
                                        constraint=constraint_from_fields(None, schema, None))])
    assert tok.decode(on["r"].output_ids).startswith('{"text": "')
    assert pair[1].speculator.stats.accepted_tokens - accepted_before > 10


@pytest.mark.server
@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2}], ids=["tp2", "pp2"])
def test_ranks_draft_alike_under_tp_and_pp(layout: dict, tiny_model_dirs, pairs) -> None:
    """The ranks' fingerprints (checked every step) cover the drafts: plain requests, and ones
    under a grammar with penalties, whose drafts every rank cuts and verifies alike."""
    from lockstep.constrained.constraint import constraint_from_fields

    model_dir = tiny_model_dirs["llama"]
    prompts = _prompts(4, seed=5)
    features = {"regex": r"(ab|cd){3,12}", "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    off = run_to_completion(pairs("llama")[0], [greedy_req(f"r{i}", p, 24) for i, p in enumerate(prompts)])
    off_features = run_to_completion(pairs("llama")[0], [
        greedy_req(f"f{i}", p, 24, constraint=constraint_from_fields(features["regex"], None, None),
                   **{k: v for k, v in features.items() if k != "regex"}) for i, p in enumerate(prompts)])
    args = ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=4096,
                      quantization="q8_0", enable_lockstep_check=1, **layout, **SPEC)
    launched = launch_subprocesses(args)
    try:
        # one at a time, so each drafts alone: the plain ones from the store, the grammar ones from
        # their own repeating output (test_features_... shows such requests take drafts in-process)
        got = generate_through(launched, prompts + prompts, 24, concurrent=False,
                               sampling=[{}] * len(prompts) + [features] * len(prompts))
    finally:
        launched.shutdown()
    assert got == ([off[f"r{i}"].output_ids for i in range(len(prompts))]
                   + [off_features[f"f{i}"].output_ids for i in range(len(prompts))])


@pytest.mark.server
def test_a_server_reports_acceptance_per_request_and_in_metrics(model_dir, tmp_path) -> None:
    """meta_info carries SGLang's spec_* figures per request; /metrics the acceptance rate and
    length over finished requests, under SGLang's names."""
    import re

    import requests

    from lockstep.testing.live_server import LiveServer

    server = LiveServer("--model-path", model_dir, "--dtype", "float32", "--quantization", "q8_0",
                        "--speculative-algorithm", "NGRAM",
                        "--speculative-ngram-min-match-window-size", "1", log_dir=tmp_path)
    try:
        body = {"input_ids": _prompts(1, seed=2)[0], "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
        meta = requests.post(server.url + "/generate", json=body, timeout=120).json()["meta_info"]
        metrics = requests.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    passes, drafted, accepted = (meta["spec_verify_ct"], meta["spec_draft_token_num"],
                                 meta["spec_accept_token_num"])
    assert passes > 0 and drafted >= accepted >= 0, meta  # a random tiny model rarely accepts
    assert meta["spec_accept_rate"] == pytest.approx(accepted / drafted)
    assert meta["spec_accept_length"] == pytest.approx((passes + accepted) / passes)
    found = {m[0]: float(m[1]) for m in re.findall(r"^(sglang:spec_accept_\w+)\{[^}]*\} (\S+)$",
                                                  metrics, re.M)}
    assert found == pytest.approx({"sglang:spec_accept_rate": accepted / drafted,
                                   "sglang:spec_accept_length": (passes + accepted) / passes})

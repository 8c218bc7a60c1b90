"""Overlap scheduling: the forward thread runs batch N while the scheduler processes batch N-1
and prepares N+1. Outputs must be exactly the plain loop's, KV accounting exact (every run ends
with the strict idle integrity check), and the hooks and aborts keep working."""

from __future__ import annotations

import random

import pytest

from lockstep.core import BaseFinishReason
from lockstep.messages import AbortReq
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion


def _sched(model_dir, overlap: bool, **kw):
    """Overlap is off by default on cpu (it does not pay there), so force it either way."""
    kw.setdefault("max_total_tokens", 4096)
    return make_scheduler(model_dir, enable_overlap_schedule=overlap, **kw)


def _both(model_dir, schedule, **kw):
    """Run `schedule` with the plain loop and the overlap loop; return both results and the
    overlap scheduler."""
    plain = run_to_completion(_sched(model_dir, False, **kw), schedule)
    sched = _sched(model_dir, True, **kw)
    assert sched.overlap
    overlap = run_to_completion(sched, schedule)
    return plain, overlap, sched


def _summary(res):
    return {rid: (r.output_ids, r.finish_reason) for rid, r in res.items()}


def _prompt(rng, n):
    return [rng.randrange(6, 500) for _ in range(n)]


def test_mixed_workload_matches_plain_loop(model_dir):
    rng = random.Random(0)
    shared = _prompt(rng, 80)
    schedule = {
        0: [greedy_req("long", _prompt(rng, 150), 12),  # chunked at 64
            greedy_req("short", _prompt(rng, 5), 20),
            greedy_req("one", _prompt(rng, 9), 1),
            greedy_req("p0", shared + _prompt(rng, 6), 10)],
        3: [greedy_req("p1", shared + _prompt(rng, 4), 8),  # radix hit on the shared prefix
            greedy_req("late", _prompt(rng, 30), 15)],
        7: [greedy_req("one-late", _prompt(rng, 12), 1),
            greedy_req("p2", shared + _prompt(rng, 3), 6)],
    }
    plain, overlap, sched = _both(model_dir, schedule, chunked_prefill_size=64)
    assert _summary(overlap) == _summary(plain)
    assert overlap["p2"].cached_tokens >= len(shared) - 1
    assert sched.stats.overlapped_steps > 10, sched.stats


def test_stop_tokens_finish_early_while_the_next_batch_runs(model_dir):
    rng = random.Random(1)
    prompts = [_prompt(rng, rng.randint(4, 40)) for _ in range(6)]
    free = run_to_completion(_sched(model_dir, False), [greedy_req(f"s{i}", p, 24) for i, p in enumerate(prompts)])
    # Stop at the token each request produced at its 4th step: it ends mid-run, while its next
    # step is already in flight (its extra token must be dropped).
    reqs = [greedy_req(f"s{i}", p, 24, stop_token_ids=[free[f"s{i}"].output_ids[3]])
            for i, p in enumerate(prompts)]
    plain, overlap, _ = _both(model_dir, reqs)
    assert _summary(overlap) == _summary(plain)
    assert all(r.finish_reason.type == "stop" and len(r.output_ids) <= 4 for r in overlap.values())


def test_eos_and_min_new_tokens(model_dir):
    rng = random.Random(2)
    free = run_to_completion(_sched(model_dir, False), [greedy_req("e", _prompt(rng, 20), 16)])
    eos = free["e"].output_ids[5]
    rng = random.Random(2)
    prompt = _prompt(rng, 20)
    reqs = [greedy_req("eos", prompt, 16, ignore_eos=False),
            greedy_req("min", prompt, 16, ignore_eos=False, min_new_tokens=10),
            greedy_req("ignored", prompt, 16)]
    sched = _sched(model_dir, True)
    sched.outputs.eos_ids = frozenset([eos])
    overlap = run_to_completion(sched, reqs)
    plain_sched = _sched(model_dir, False)
    plain_sched.outputs.eos_ids = frozenset([eos])
    plain = run_to_completion(plain_sched, reqs)
    assert _summary(overlap) == _summary(plain)
    assert overlap["eos"].finish_reason.type == "stop"


def test_retraction_under_kv_pressure_matches_plain_loop(model_dir):
    rng = random.Random(3)
    reqs = [greedy_req(f"r{i}", _prompt(rng, rng.randint(4, 40)), rng.randint(8, 30)) for i in range(24)]
    demand = sum(len(r.input_ids) + r.sampling_params.max_new_tokens for r in reqs)
    plain, overlap, sched = _both(model_dir, reqs, max_total_tokens=demand // 4,
                                  max_running_requests=64, new_token_ratio=0.05)
    assert sched.stats.retractions > 0, "the pool was meant to force retractions"
    assert _summary(overlap) == _summary(plain)


def test_mixed_chunk_matches_plain_loop(model_dir):
    rng = random.Random(4)
    schedule = {s: [greedy_req(f"m{s}", _prompt(rng, 40 + 7 * s), 10)] for s in range(0, 12, 3)}
    plain, overlap, _ = _both(model_dir, schedule, chunked_prefill_size=32, enable_mixed_chunk=True)
    assert _summary(overlap) == _summary(plain)


def test_seeded_sampling_penalties_and_logprobs_match(model_dir):
    rng = random.Random(5)
    reqs = [greedy_req(f"t{i}", _prompt(rng, 10 + i), 12, temperature=0.9, top_p=0.9, seed=i)
            for i in range(4)]
    reqs += [greedy_req("unseeded", _prompt(rng, 12), 12, temperature=1.0),
             greedy_req("pen", _prompt(rng, 12), 12, frequency_penalty=0.5, repetition_penalty=1.3),
             greedy_req("lp", _prompt(rng, 12), 12, return_logprob=True, top_logprobs_num=2)]
    plain, overlap, _ = _both(model_dir, reqs)
    assert _summary(overlap) == _summary(plain)
    assert overlap["lp"].logprobs == pytest.approx(plain["lp"].logprobs, abs=1e-5)
    assert len(overlap["lp"].logprobs) == 12


def test_abort_while_its_batch_is_in_flight_frees_kv_once(model_dir):
    rng = random.Random(6)
    reqs = [greedy_req(f"a{i}", _prompt(rng, 20), 30) for i in range(4)]
    sched = _sched(model_dir, True)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, BaseFinishReason] = {}

    def step(msgs=()):
        for out in sched.step(msgs):
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                assert out.rid not in reasons, f"{out.rid} finished twice"
                reasons[out.rid] = out.finish_reason

    step(reqs)
    for _ in range(5):
        step()
    assert sched.loop.inflight is not None and any(r.rid == "a1" for r in sched.loop.inflight.batch.reqs)
    # a1 is in the batch in flight; a2 is aborted twice (the second one finds nothing).
    step([AbortReq("a1"), AbortReq("a2"), AbortReq("a2")])
    assert reasons["a1"].type == reasons["a2"].type == "abort"
    while not sched.is_idle():
        step()
    sched.check_integrity()  # strict: a slot freed twice or never would raise
    assert len(tokens["a1"]) < 30 and len(tokens["a2"]) < 30
    plain = run_to_completion(_sched(model_dir, False), [reqs[0], reqs[3]])
    assert tokens["a0"] == plain["a0"].output_ids and tokens["a3"] == plain["a3"].output_ids


def test_row_of_a_finished_request_is_not_reused_under_the_batch_in_flight(model_dir, monkeypatch):
    """A finishes while its extra step is in flight; B is admitted next step and would take A's
    row at once. The slowed forward thread reads A's row only after that: without parking, A's
    extra token would attend to B's slots, and that KV (owned by the prefix tree) would then be
    served to C, which extends A's whole sequence."""
    import time

    rng = random.Random(10)
    prompt, b_prompt = _prompt(rng, 20), _prompt(rng, 20)
    a_out = run_to_completion(_sched(model_dir, False), [greedy_req("A", prompt, 3)])["A"].output_ids
    schedule = {0: [greedy_req("A", prompt, 3)], 4: [greedy_req("B", b_prompt, 4)],
                10: [greedy_req("C", prompt + a_out + [42], 6)]}
    plain = run_to_completion(_sched(model_dir, False), schedule)
    sched = _sched(model_dir, True)
    forward = sched.worker.forward_batch_generation

    def slow(batch):
        time.sleep(0.05)
        return forward(batch)

    monkeypatch.setattr(sched.worker, "forward_batch_generation", slow)
    overlap = run_to_completion(sched, schedule)
    assert overlap["C"].cached_tokens == len(prompt) + len(a_out)
    assert _summary(overlap) == _summary(plain)


def test_integrity_check_runs_only_with_nothing_in_flight(model_dir, monkeypatch):
    sched = _sched(model_dir, True)
    seen = []
    real = sched.check_integrity

    def check():
        seen.append(sched.loop.inflight)
        real()

    monkeypatch.setattr(sched, "check_integrity", check)
    rng = random.Random(7)
    run_to_completion(sched, {0: [greedy_req("i0", _prompt(rng, 8), 5)], 20: [greedy_req("i1", _prompt(rng, 8), 3)]})
    for _ in range(3):
        sched.step()
    assert seen and all(s is None for s in seen)


def test_hooks_see_every_step_and_ranks_agree(model_dir):
    rng = random.Random(8)
    reqs = [greedy_req(f"h{i}", _prompt(rng, 6 + 5 * i), 6 + i) for i in range(5)]
    a, b = (_sched(model_dir, True, debug_fingerprints=True) for _ in range(2))
    calls = []
    a.before_run = lambda step, fp: calls.append(step)
    run_to_completion(a, reqs)
    run_to_completion(b, reqs)
    assert a.fingerprints == b.fingerprints and len(a.fingerprints) > 5
    assert calls == list(range(a.step_count))


def test_forward_thread_failure_reaches_the_scheduler(model_dir, monkeypatch):
    sched = _sched(model_dir, True)

    def boom(batch):
        raise ValueError("forward failed")

    monkeypatch.setattr(sched.worker, "forward_batch_generation", boom)
    with pytest.raises(RuntimeError, match="forward thread") as info:
        for _ in range(3):
            sched.step([greedy_req("f", [7, 8, 9], 4)] if sched.step_count == 0 else [])
    assert isinstance(info.value.__cause__, ValueError)


def test_resolved_setting():
    assert ServerArgs(device="cuda").overlap_schedule
    assert not ServerArgs(device="cpu").overlap_schedule
    assert ServerArgs(device="cpu", enable_overlap_schedule=True).overlap_schedule
    assert not ServerArgs(device="cuda", enable_overlap_schedule=False).overlap_schedule
    assert not ServerArgs(device="cuda", pp_size=2).overlap_schedule


@pytest.mark.server
def test_tp2_processes_with_overlap_match_a_single_rank(model_dir):
    from lockstep.entrypoints.engine import launch_subprocesses
    from lockstep.testing.inproc import generate_through

    rng = random.Random(9)
    prompts = [_prompt(rng, rng.randint(4, 30)) for _ in range(5)]
    ref = run_to_completion(_sched(model_dir, False), [greedy_req(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    args = ServerArgs(model_path=str(model_dir), dtype="float32", tp_size=2, max_total_tokens=4096,
                      enable_lockstep_check=1, enable_overlap_schedule=True)
    assert args.overlap_schedule
    launched = launch_subprocesses(args)
    try:
        assert generate_through(launched, prompts, 12) == [ref[f"r{i}"].output_ids for i in range(5)]
    finally:
        launched.shutdown()

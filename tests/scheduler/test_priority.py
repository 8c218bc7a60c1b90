"""Priority scheduling (--enable-priority-scheduling): the waiting queue by priority, a running
request preempted for a more urgent one when KV or running slots are short and resumed with the
same output, the companions (threshold, low-values-first, no preemption), and a priority refused
where the server does not schedule by it."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from lockstep.managers.scheduler import Scheduler
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion

PROMPT_LEN, MAX_NEW = 40, 30


def _reqs(n: int, seed: int, priority: int | None, prefix: str) -> list[Any]:
    rng = random.Random(seed)
    return [greedy_req(f"{prefix}{i}", [rng.randrange(6, 500) for _ in range(PROMPT_LEN)],
                       MAX_NEW, priority=priority) for i in range(n)]


def _run_in_order(sched: Scheduler, timed: dict[int, list[Any]]) -> tuple[dict[str, list[int]],
                                                                          list[str]]:
    """Step to the end: each request's output, and the order in which they finished."""
    outputs: dict[str, list[int]] = {}
    finished: list[str] = []
    for step in range(10_000):
        for out in sched.step(timed.get(step, [])):
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                assert out.finish_reason.type == "length", out.finish_reason
                finished.append(out.rid)
        if step >= max(timed) and sched.is_idle():
            sched.check_integrity()
            return outputs, finished
    raise RuntimeError("requests still unfinished")


def _watch(sched: Scheduler, at: int) -> tuple[set[str], list[str]]:
    """(rids waiting when step `at` begins, rids preempted from then on), filled as it runs."""
    waiting: set[str] = set()
    preempted: list[str] = []
    step, retract = sched.run_step, sched.retract

    def run_step(msgs: Any) -> Any:
        if sched.step_count == at:
            waiting.update(r.rid for r in sched.waiting)
        return step(msgs)

    def watched(victim: Any) -> None:
        preempted.append(victim.rid)
        retract(victim)

    sched.run_step, sched.retract = run_step, watched  # type: ignore[method-assign]
    return waiting, preempted


def _alone(model_dir, reqs: list[Any]) -> dict[str, list[int]]:
    """Each request's output served by itself in a pool with room for everything."""
    out = {}
    for r in reqs:
        r = dataclasses.replace(r, priority=None)  # this server schedules without priorities
        res = run_to_completion(make_scheduler(model_dir, max_total_tokens=4000), [r])
        out[r.rid] = res[r.rid].output_ids
    return out


# A pool of 3 requests' worth of KV (prompt + output), so lows fill it and queue behind.
POOL = 3 * (PROMPT_LEN + MAX_NEW) + 8


@pytest.mark.parametrize("overlap", [False, True])
def test_urgent_request_overtakes_a_full_pool_and_preempted_ones_keep_their_outputs(model_dir, overlap):
    lows = _reqs(6, seed=1, priority=0, prefix="low")
    high = _reqs(1, seed=2, priority=100, prefix="high")
    sched = make_scheduler(model_dir, max_total_tokens=POOL, new_token_ratio=1.0,
                           enable_priority_scheduling=True, enable_overlap_schedule=overlap)
    queued, preempted = _watch(sched, 6)
    outputs, finished = _run_in_order(sched, {0: lows, 6: high})  # step 6: lows are decoding
    # It came behind a full pool and a queue of lows; it finished before every one of them that
    # was queued or that it preempted (the pool held no room for it without preempting).
    assert len(queued) >= 2 and preempted, (queued, preempted)
    assert all(finished.index("high0") < finished.index(r) for r in queued | set(preempted)), (
        finished, queued, preempted)
    assert outputs == _alone(model_dir, lows + high)


def test_without_priorities_the_same_load_serves_in_arrival_order(model_dir):
    """The control: the same requests with priority scheduling off finish the urgent one last
    among those it arrived behind (the test above fails without priorities)."""
    lows = _reqs(6, seed=1, priority=None, prefix="low")
    high = _reqs(1, seed=2, priority=None, prefix="high")
    sched = make_scheduler(model_dir, max_total_tokens=POOL, new_token_ratio=1.0)
    queued, preempted = _watch(sched, 6)
    _, finished = _run_in_order(sched, {0: lows, 6: high})
    assert len(queued) >= 2 and not preempted
    assert all(finished.index("high0") > finished.index(r) for r in queued), (finished, queued)


def test_running_slots_short_preempts_too(model_dir):
    lows = _reqs(2, seed=3, priority=1, prefix="low")
    high = _reqs(1, seed=4, priority=50, prefix="high")
    sched = make_scheduler(model_dir, max_total_tokens=4000, max_running_requests=2,
                           enable_priority_scheduling=True)
    _, preempted = _watch(sched, 4)
    outputs, finished = _run_in_order(sched, {0: lows, 4: high})
    # Both slots held lows; one gave its slot up and finished after the urgent one.
    assert len(preempted) == 1 and finished == [*(r for r in ("low0", "low1") if r != preempted[0]),
                                                 "high0", preempted[0]], (finished, preempted)
    assert outputs == _alone(model_dir, lows + high)


def test_threshold_and_disabled_preemption_keep_running_requests(model_dir):
    lows = _reqs(2, seed=3, priority=1, prefix="low")
    for opts, urgent in (({"priority_scheduling_preemption_threshold": 60}, 50),
                         ({"disable_priority_preemption": True}, 50)):
        high = _reqs(1, seed=4, priority=urgent, prefix="high")
        sched = make_scheduler(model_dir, max_total_tokens=4000, max_running_requests=2,
                               enable_priority_scheduling=True, **opts)
        _, finished = _run_in_order(sched, {0: lows, 4: high})
        assert finished[-1] == "high0", (opts, finished)
        assert sched.stats.retractions == 0


@pytest.mark.parametrize("low_first", [False, True])
def test_waiting_queue_admits_the_most_urgent_first(model_dir, low_first):
    """One running slot: the queue drains by priority (larger first by default; smaller first
    with --schedule-low-priority-values-first), arrival order within a level."""
    prios = [3, 9, 1, 9, 5]
    reqs = [greedy_req(f"r{i}", [10 + i, 20, 30], 2, priority=p) for i, p in enumerate(prios)]
    sched = make_scheduler(model_dir, max_total_tokens=4000, max_running_requests=1,
                           enable_priority_scheduling=True, disable_priority_preemption=True,
                           schedule_low_priority_values_first=low_first)
    _, finished = _run_in_order(sched, {0: reqs})
    expect = (["r2", "r0", "r4", "r1", "r3"] if low_first else ["r1", "r3", "r4", "r0", "r2"])
    assert finished == expect


def test_unset_priority_is_the_least_urgent_unless_a_default_is_set(model_dir):
    reqs = [greedy_req("none", [10, 20, 30], 2), greedy_req("one", [11, 20, 30], 2, priority=1)]
    for default, first in ((None, "one"), (5, "none")):
        sched = make_scheduler(model_dir, max_total_tokens=4000, max_running_requests=1,
                               enable_priority_scheduling=True, default_priority_value=default)
        _, finished = _run_in_order(sched, {0: reqs})
        assert finished[0] == first, (default, finished)


def test_a_priority_without_priority_scheduling_is_refused(model_dir):
    sched = make_scheduler(model_dir, max_total_tokens=1000)
    res = run_to_completion(sched, [greedy_req("p", [10, 11], 2, priority=3)])
    reason = res["p"].finish_reason
    assert reason.type == "abort" and reason.status_code == 400
    assert "--enable-priority-scheduling" in reason.message


def test_two_schedulers_with_priorities_decide_identically(model_dir):
    reqs = _reqs(8, seed=5, priority=0, prefix="low") + _reqs(3, seed=6, priority=40, prefix="hi")
    timed = {i * 2: [r] for i, r in enumerate(reqs)}
    prints = []
    for _ in range(2):
        sched = make_scheduler(model_dir, max_total_tokens=POOL, new_token_ratio=1.0,
                               enable_priority_scheduling=True, debug_fingerprints=True)
        _run_in_order(sched, timed)
        assert sched.stats.retractions > 0
        prints.append(sched.fingerprints)
    assert prints[0] == prints[1]

"""Pipeline micro-batches: a batch split by requests computes the same rows as the whole batch,
pipelines with 1, 2 or 3 micro-batches generate what a single rank generates, and the first
stage really keeps several micro-batches on their way at once."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
from typing import Any

import pytest
import torch

from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.forward_batch import ForwardMode, micro_batch_ranges, split_forward_batch
from lockstep.managers.schedule_batch import ModelWorkerBatch
from lockstep.messages import TokenizedGenerateReq
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import generate_through, greedy_req, make_scheduler, run_to_completion
from lockstep.testing.tiny_models import tiny_prompts
from lockstep.utils.process import free_port

MAX_NEW = 8
N_PROMPTS = 7  # odd, so 2 and 3 micro-batches are uneven


def _requests(prompts: list[list[int]]) -> list[TokenizedGenerateReq]:
    return [greedy_req(f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)]


def _reference(model_dir: Any, prompts: list[list[int]]) -> list[list[int]]:
    res = run_to_completion(make_scheduler(model_dir, max_total_tokens=4096), _requests(prompts))
    return [res[f"r{i}"].output_ids for i in range(len(prompts))]


@pytest.mark.parametrize("lens,n,expected", [
    ([1] * 6, 2, [(0, 3), (3, 6)]),
    ([1] * 7, 3, [(0, 3), (3, 5), (5, 7)]),
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),  # token-balanced: the long prefill alone
    ([1, 1, 1, 1, 1, 30], 3, [(0, 4), (4, 5), (5, 6)]),  # every range keeps a request
    ([5, 5], 3, [(0, 1), (1, 2)]),  # never more ranges than requests
    ([9], 4, [(0, 1)]),
])
def test_micro_batch_ranges(lens, n, expected):
    assert micro_batch_ranges(lens, n) == expected


# ---- (a) the split itself, on one rank ---------------------------------------------------------

def test_split_batches_compute_the_whole_batch_rows(tiny_model_dirs):
    """Every step of a real schedule (prefills of different lengths, prefill chunks mixed with
    decodes, plain decodes) is also run as 2 and 3 micro-batches through the same single-rank
    model: same hidden rows, same tokens, same prompt logprobs. The whole batch runs last, so
    the KV it writes is what later steps read, exactly as without the check."""
    model_dir = tiny_model_dirs["gemma3"]  # sliding-window layers too
    sched = make_scheduler(model_dir, max_total_tokens=4096, enable_mixed_chunk=True,
                           chunked_prefill_size=48)
    worker = sched.worker
    whole_run = worker.forward_batch_generation
    modes_checked: set[ForwardMode] = set()

    def checked(batch: ModelWorkerBatch):
        fb = batch.forward_batch
        for n in (2, 3):
            parts = split_forward_batch(fb, n)
            assert len(parts) == min(n, fb.batch_size)
            assert sum(p.batch_size for p in parts) == fb.batch_size
            split_hidden = worker.runner.forward_micro_batches(parts)
            whole_hidden = worker.runner.forward(fb)
            # Other GEMM shapes sum in another order: float32 rounding (hidden rows reach ~10;
            # measured gaps ~1e-4 after the last layer), far below what flips a token.
            torch.testing.assert_close(split_hidden, whole_hidden, rtol=1e-4, atol=1e-3)
            split_res, whole_res = worker._sample(split_hidden, batch), worker._sample(whole_hidden, batch)
            assert split_res.next_token_ids == whole_res.next_token_ids
            assert _flat(split_res.prompt_logprobs) == pytest.approx(_flat(whole_res.prompt_logprobs), abs=1e-4)
        if fb.batch_size >= 2:
            modes_checked.add(fb.mode)
        return whole_run(batch)

    worker.forward_batch_generation = checked
    prompts = tiny_prompts(model_dir, 5, seed=3, min_words=5, max_words=40)
    first = [greedy_req(f"a{i}", p, 12) for i, p in enumerate(prompts[:3])]
    first.append(greedy_req("lp", prompts[3], 12, return_logprob=True, logprob_start_len=0))
    # A long prompt arriving while the others decode: its chunks share batches with decodes.
    late = [greedy_req("late", prompts[4] * 4, 4)]
    res = run_to_completion(sched, {0: first, 4: late})
    assert all(len(r.output_ids) for r in res.values())
    assert modes_checked == {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED}


def _flat(rows: list[list[tuple[float, int]] | None]) -> list[float]:
    return [lp for r in rows if r for lp, _ in r]


# ---- (b, c) ranks as processes: a pipeline with 1, 2 and 3 micro-batches ------------------------

def _pipeline_rank(rank: int, tp: int, pp: int, addr: str, model_dir: str,
                   prompts: list[list[int]], splits: list[int], results: Any) -> None:
    """One rank of a tp x pp replica, built as a scheduler process builds it, driven by the
    same requests as every other rank (as the scheduler processes are after their input
    broadcast). Runs the requests once per micro-batch count and reports outputs and stats."""
    import torch.distributed as dist

    from lockstep.distributed.communication import (
        init_distributed,
        make_pipeline_group,
        make_tp_group,
        make_world_group,
    )
    from lockstep.managers.scheduler import create_scheduler

    torch.set_num_threads(1)
    world = tp * pp
    tp_rank, pp_rank = rank % tp, rank // tp
    init_distributed(addr, world, rank, "cpu")
    world_group = make_world_group(world, rank)
    tp_group = make_tp_group(tp, tp_rank, pp_rank, pp, "cpu")
    pp_group = make_pipeline_group(tp, pp, tp_rank, pp_rank, world_group)
    out: dict[int, Any] = {}
    for k in splits:
        args = ServerArgs(model_path=model_dir, dtype="float32", max_total_tokens=4096,
                          tp_size=tp, pp_size=pp, pp_micro_batches=k)
        sched = create_scheduler(args, tp_group, pp_group, local_ranks=world, strict_integrity=True)
        sched.worker.micro_batches = k  # the count a scheduler process sets from --pp-micro-batches
        res = run_to_completion(sched, _requests(prompts))
        out[k] = ([res[f"r{i}"].output_ids for i in range(len(prompts))],
                  dataclasses.asdict(sched.worker.runner.pp_stats))
    results.put((rank, out))
    dist.destroy_process_group()


def _run_pipeline(tp: int, pp: int, model_dir: Any, prompts: list[list[int]],
                  splits: list[int]) -> dict[int, dict[int, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_pipeline_rank,
                         args=(r, tp, pp, addr, str(model_dir), prompts, splits, results))
             for r in range(tp * pp)]
    for p in procs:
        p.start()
    got: dict[int, dict[int, Any]] = {}
    try:
        while len(got) < len(procs):
            try:
                rank, out = results.get(timeout=5)
                got[rank] = out
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a pipeline rank died") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


@pytest.mark.server
@pytest.mark.parametrize("arch,tp", [("llama", 1), ("qwen3", 2)])
def test_micro_batches_match_a_single_rank_and_are_in_flight(arch, tp, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    prompts = tiny_prompts(model_dir, N_PROMPTS, seed=11, max_words=40)
    expected = _reference(model_dir, prompts)
    splits = [1, 2, 3] if tp == 1 else [2]
    got = _run_pipeline(tp, 2, model_dir, prompts, splits)
    first_stage = range(tp)
    for k in splits:
        for rank, out in got.items():
            outputs, stats = out[k]
            assert outputs == expected, f"rank {rank}, {k} micro-batches"
            # Every step that had requests to split ran min(k, batch) micro-batches.
            assert stats["micro_batches"] > stats["steps"] or k == 1
            if rank in first_stage:
                # The first stage sent micro-batch i+1 before waiting for i's send: k of them
                # were on their way at once (decode steps hold all 7 requests).
                assert stats["max_sends_in_flight"] == k


@pytest.mark.server
def test_real_processes_pp2_micro_batches(tiny_model_dirs):
    """The served path, scheduler processes started by the launcher, asked for micro-batches."""
    model_dir = tiny_model_dirs["gemma3"]
    prompts = tiny_prompts(model_dir, N_PROMPTS, seed=21, max_words=40)
    expected = _reference(model_dir, prompts)
    args = ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=4096,
                      pp_size=2, pp_micro_batches=2, enable_lockstep_check=4)
    launched = launch_subprocesses(args)
    try:
        assert generate_through(launched, prompts, MAX_NEW) == expected
    finally:
        launched.shutdown()


def test_micro_batch_default_follows_the_device():
    from lockstep.server_args import ServerArgs

    assert ServerArgs(pp_size=2).micro_batches == 1  # cpu: splitting measured slower
    assert ServerArgs(pp_size=2, device="cuda").micro_batches == 2
    assert ServerArgs(pp_size=2, pp_micro_batches=3).micro_batches == 3

"""The process model with real processes: scheduler ranks over torch.distributed (gloo), ZMQ
between front, schedulers and detokenizer. Greedy output must not depend on the TP size."""

from __future__ import annotations

import psutil
import pytest

from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import generate_through, greedy_req, make_scheduler, run_to_completion
from lockstep.testing.tiny_models import TINY_ARCHS, tiny_prompts

pytestmark = pytest.mark.server  # every test here launches scheduler ranks as processes

MAX_NEW = 16


def _launch(model_dir, tp: int, **kw):
    args = ServerArgs(model_path=str(model_dir), dtype="float32", tp_size=tp, max_total_tokens=4096, **kw)
    return launch_subprocesses(args)


def _reference(model_dir, prompts):
    res = run_to_completion(make_scheduler(model_dir, max_total_tokens=4096),
                            [greedy_req(f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)])
    return [res[f"r{i}"].output_ids for i in range(len(prompts))]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tp_sizes_give_identical_greedy_outputs_and_process_tree(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    prompts = tiny_prompts(model_dir, 6, seed=11, max_words=40)
    expected = _reference(model_dir, prompts)
    me = psutil.Process()
    param_bytes = {}  # tp -> each rank's parameter bytes by kind
    # tp 1 through real processes once (llama); the in-process reference covers tp 1 for all.
    for tp in ((1, 2, 4) if arch == "llama" else (2, 4)):
        launched = _launch(model_dir, tp, enable_lockstep_check=2)
        try:
            param_bytes[tp] = [r["param_bytes"] for r in launched.info["ranks"]]
            # front (this process) + tp schedulers + detokenizer
            kids = {p.pid for p in me.children(recursive=False)}
            assert {p.pid for p in launched.children} <= kids
            titles = sorted(psutil.Process(p.pid).cmdline()[0] for p in launched.children)
            assert len(launched.children) == tp + 1, titles
            assert sum(t.startswith("lockstep::scheduler TP") for t in titles) == tp, titles
            assert "lockstep::detokenizer" in titles
            assert generate_through(launched, prompts, MAX_NEW) == expected, f"{arch} tp={tp}"
        finally:
            launched.shutdown()
        assert not any(psutil.pid_exists(p.pid) and psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE
                       for p in launched.children)
    if arch == "llama":
        # The llama case's tp 1 and tp 2 launches double as the check that each rank holds its
        # share of the parallel weights (they once started two more servers of their own).
        check_each_rank_holds_its_share_of_parallel_weights(param_bytes)


def check_each_rank_holds_its_share_of_parallel_weights(sizes: dict[int, list[dict]]) -> None:
    parallel = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")
    for kind in parallel:
        full = sizes[1][0][kind]
        for rank in sizes[2]:
            # KV heads split evenly here (2 KV heads over 2 ranks): exactly half.
            assert rank[kind] == full // 2, (kind, rank[kind], full)
    assert all(r["total"] < 0.6 * sizes[1][0]["total"] for r in sizes[2])

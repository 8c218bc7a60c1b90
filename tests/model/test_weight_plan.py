"""The weight plan (layers/weight_plan.py): one decision at load of which kernel multiplies each part
of each linear, read from the kernels' block-type table; its summary in the log and /get_server_info;
and float32 checkpoints on the exact kernel, so a request alone and inside a batch of 32 gives the
same bits."""

from __future__ import annotations

import logging

import pytest
import torch

from lockstep import kernels
from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.kernels import INT8_QTYPES, BlockType
from lockstep.layers.block_weight import BlockWeight, Kind, part_kind
from lockstep.layers.weight_plan import Target, WeightPlan, choose, readable
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.tiny_models import tiny_prompts

CPU = torch.device("cpu")
ALL_KERNELS = frozenset({"linear", "linear_int8", "linear_bf16"})


def target(dtype: torch.dtype = torch.float32, int8: bool = False, device: str = "cpu",
           compiled: frozenset[str] = ALL_KERNELS) -> Target:
    return Target(torch.device(device), dtype, int8, "avx512", compiled)


@pytest.mark.parametrize("qtype", list(BlockType))
def test_every_type_in_the_block_table_is_planned_from_the_table(qtype: BlockType) -> None:
    """Each BlockType gets a block kind with no entry of its own in the plan: int8 where the table
    lists an int8 path (INT8_QTYPES), else exact; bfloat16 on AMX; floats on a GPU, and where the
    kernels are not compiled, with the reason recorded."""
    k = 256
    assert choose(qtype, k, target()) == (Kind.EXACT, "")
    assert choose(qtype, k, target(int8=True))[0] is (Kind.INT8 if qtype in INT8_QTYPES else Kind.EXACT)
    assert choose(qtype, k, target(torch.bfloat16))[0] is Kind.AMX_BF16
    kind, why = choose(qtype, k, target(device="cuda"))
    assert kind is Kind.FLOAT and "cuda" in why
    kind, why = choose(qtype, k, target(torch.bfloat16, compiled=frozenset({"linear"})))
    assert kind is Kind.FLOAT and "bfloat16" in why
    kind, why = choose(qtype, k, target(compiled=frozenset()))
    assert kind is Kind.FLOAT and "no compiled kernel" in why


def test_float_rows_of_partial_groups_stay_float() -> None:
    kind, why = choose(BlockType.F32, 48, target())
    assert kind is Kind.FLOAT and "groups of 32" in why


def test_a_type_the_table_lacks_is_a_recorded_fallback() -> None:
    """The loader dequantizes a GGML type the table does not list (readable: None) into F32 rows
    that name it; the plan runs them on the exact kernel and records why they are not blocks."""
    assert readable("Q8_0") is BlockType.Q8_0 and readable("NOT_A_TYPE") is None
    plan = WeightPlan(target())
    rows = torch.randn(64, 64)
    (part,) = plan.parts([BlockWeight(rows.view(torch.uint8), BlockType.F32, 64, "w", stored="NOT_A_TYPE")])
    assert part.kind is Kind.EXACT and torch.equal(part.dequantize(), rows)
    s = plan.summary()
    assert s["parts"] == {"exact": {"NOT_A_TYPE": 1}}
    assert s["fallbacks"] == {"NOT_A_TYPE": "no kernel for NOT_A_TYPE here: dequantized to float32 at load"}
    assert "NOT_A_TYPE (no kernel for NOT_A_TYPE here" in plan.describe()


def test_parts_of_one_kind_merge_and_float_fallbacks_are_dequantized_once() -> None:
    q8 = BlockWeight(kernels.quantize("Q8_0", torch.randn(32, 64)), BlockType.Q8_0, 64, "a")
    plan = WeightPlan(target(compiled=frozenset()))  # nothing compiled: floats, merged into one tensor
    (part,) = plan.parts([q8, q8])
    assert part_kind(part) is Kind.FLOAT and part.shape == (64, 64)
    assert plan.summary()["parts"] == {"float": {"Q8_0": 2}} and "Q8_0" in plan.fallbacks
    plan = WeightPlan(target(int8=True))
    (part,) = plan.parts([q8, q8])  # one int8 part of both
    assert part.kind is Kind.INT8 and part.shape == (64, 64)


@pytest.mark.skipif(not kernels.compiled("linear"), reason="float32 rows run on the exact kernel where it is compiled")
def test_a_float_checkpoint_runs_on_f32_rows_and_the_plan_says_so(tiny_model_dirs, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="lockstep.model_executor.weight_setup"):
        sched = make_scheduler(tiny_model_dirs["qwen3"], max_total_tokens=1024)
    runner = sched.worker.runner
    linears = [m for m in runner.model.modules() if hasattr(m, "parts") and hasattr(m, "part_keys")]
    assert linears and all(m.weight is None and [p.kind for p in m.parts] == [Kind.EXACT] for m in linears)
    assert all(p.qtype is BlockType.F32 for m in linears for p in m.parts)
    summary = runner.weight_plan.summary()
    # 4 layers x (qkv, o, gate_up, down), and the untied head
    assert summary["parts"] == {"exact": {"F32": 4 * 4 + 1}} and summary["fallbacks"] == {}
    assert any(r.message == runner.weight_plan.describe() for r in caplog.records)


@pytest.mark.skipif(not kernels.compiled("linear"), reason="float32 rows run on the exact kernel where it is compiled")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_float_checkpoint_is_batch_invariant_bitwise(arch: str, tiny_model_dirs) -> None:
    """An HF float32 model without --quantization: a request alone gives the ids and logprobs,
    bitwise, it gives inside a batch of 32 of mixed lengths (torch's matmul, whose reduction order
    follows the batch, gave logprobs ~5e-6 apart)."""
    model_dir = tiny_model_dirs[arch]
    prompts = tiny_prompts(model_dir, 32, seed=8)
    sched = make_scheduler(model_dir, max_total_tokens=8192, disable_radix_cache=True, chunked_prefill_size=-1)

    def run(ids: list[int], tag: str) -> dict:
        return run_to_completion(sched, [greedy_req(f"{tag}{i}", prompts[i], 10, return_logprob=True) for i in ids])

    batched = run(list(range(32)), "b")
    for i in (0, 5, 31):
        alone = run([i], "a")[f"a{i}"]
        assert alone.output_ids == batched[f"b{i}"].output_ids, i
        assert alone.logprobs == batched[f"b{i}"].logprobs, i  # bitwise: the same floats


@pytest.mark.server
def test_server_info_carries_the_plan(tiny_model_dirs) -> None:
    """/get_server_info's weight_plan is the summary the scheduler's plan gave at load."""
    model_dir = tiny_model_dirs["qwen2"]
    want = make_scheduler(model_dir, max_total_tokens=2048, quantization="q8_0").worker.runner.weight_plan.summary()
    launched = launch_subprocesses(ServerArgs(model_path=str(model_dir), max_total_tokens=2048, quantization="q8_0"))
    try:
        got = launched.server_info()["weight_plan"]
    finally:
        launched.shutdown()
    assert got == want and sum(n for kinds in got["parts"].values() for n in kinds.values()) == 4 * 4 + 1

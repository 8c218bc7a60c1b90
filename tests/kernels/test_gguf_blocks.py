"""GGUF weights kept in their blocks: block layers against float references, TP 2 == TP 1 bitwise, types the kernels lack, and the default model served on its own blocks."""

from __future__ import annotations

import logging

import gguf
import pytest
import torch
import torch.nn.functional as F

from lockstep import kernels
from lockstep.distributed.parallel_state import SINGLE, ParallelGroup
from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.kernels import compiled, quantize
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.embedding import VocabParallelEmbedding
from lockstep.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from lockstep.layers.weight_plan import Target, WeightPlan
from lockstep.model_loader import resolve_model
from lockstep.server_args import ServerArgs
from lockstep.testing.gguf_writer import QTYPE, write_gguf
from lockstep.testing.inproc import generate_through, greedy_req, make_scheduler, run_to_completion
from lockstep.testing.oracle import greedy_matches, hf_greedy
from lockstep.testing.tiny_models import tiny_hf_model

torch.manual_seed(0)


def blocks(qtype: str, rows: int, cols: int, name: str = "w") -> BlockWeight:
    w = torch.randn(rows, cols) * 0.1
    return BlockWeight(quantize(qtype, w), kernels.block_type(qtype), cols, name)


def cpu_plan(int8: bool = False) -> WeightPlan:
    return WeightPlan(Target.here("cpu", torch.float32, int8))


def test_fused_qkv_with_parts_of_different_types_equals_the_float_reference():
    """q/k in Q5_0, v in Q8_0 (as the default GGUF's attention has in some layers)."""
    layer = QKVParallelLinear(64, 16, 4, 2, True, SINGLE, torch.float32)
    q, k, v = blocks("Q5_0", 64, 64, "q"), blocks("Q5_0", 32, 64, "k"), blocks("Q8_0", 32, 64, "v")
    bias = torch.randn(128)
    for shard, w in zip("qkv", (q, k, v)):
        layer.weight_loader(layer.weight, w, shard)
    layer.weight_loader(layer.bias, bias[:64], "q")
    layer.weight_loader(layer.bias, bias[64:96], "k")
    layer.weight_loader(layer.bias, bias[96:], "v")
    layer.finish_loading(cpu_plan())
    x = torch.randn(5, 64)
    ref = F.linear(x, torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]), bias)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    if compiled("linear"):  # q+k merged into one part, v its own
        assert [p.qtype for p in layer.parts] == ["Q5_0", "Q8_0"] and layer.weight is None


def test_merged_gate_up_and_row_parallel_blocks_equal_the_float_reference():
    gate_up = MergedColumnParallelLinear(64, [96, 96], False, SINGLE, torch.float32)
    gate, up = blocks("Q4_0", 96, 64), blocks("Q4_0", 96, 64)
    gate_up.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight_loader(gate_up.weight, up, 1)
    down = RowParallelLinear(96, 64, False, SINGLE, torch.float32)
    down_w = blocks("Q8_0", 64, 96)
    down.weight_loader(down.weight, down_w)
    for m in (gate_up, down):
        m.finish_loading(cpu_plan())
    x = torch.randn(3, 64)
    full = torch.cat([gate.dequantize(), up.dequantize()])
    torch.testing.assert_close(gate_up(x), x @ full.T, rtol=1e-5, atol=1e-5)
    h = torch.randn(3, 96)
    torch.testing.assert_close(down(h), h @ down_w.dequantize().T, rtol=1e-5, atol=1e-5)


def test_embedding_reads_rows_from_blocks_and_a_tied_head_multiplies_by_them():
    table = blocks("Q8_0", 50, 64, "token_embd.weight")
    emb = VocabParallelEmbedding(50, 64, SINGLE, torch.float32, serves_logits=True)
    emb.weight_loader(emb.weight, table)
    emb.finish_loading(cpu_plan())
    assert emb.weight is None and emb.table is not None  # no float copy of the table for lookups
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(emb(ids), table.dequantize()[ids])
    h = torch.randn(2, 64)
    torch.testing.assert_close(emb.logits(h), h @ table.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
def test_tp2_row_parallel_ranks_compute_tp1s_output_rows_bitwise(int8):
    """A row-parallel rank multiplies the gathered x by its share of W's output rows, so its
    outputs are TP 1's bits. The input is 3 Q8_0 blocks, which do not split over 2 ranks (an
    all-reduce of partial sums could not shard it, and would round differently)."""
    w = blocks("Q8_0", 48, 96)
    x = torch.randn(4, 96)
    full = RowParallelLinear(96, 48, False, SINGLE, torch.float32)
    full.weight_loader(full.weight, w)
    full.finish_loading(cpu_plan(int8))
    want = full(x)
    for rank in range(2):
        m = RowParallelLinear(96, 48, False, ParallelGroup(rank=rank, size=2), torch.float32)
        m.weight_loader(m.weight, w)
        m.finish_loading(cpu_plan(int8))
        # forward gathers x and then these rows; the gathers only copy
        assert torch.equal(m._matmul(x, None), want[:, rank * 24:(rank + 1) * 24]), rank


def test_a_gguf_with_types_the_kernels_lack_loads_dequantized(tmp_path, monkeypatch, caplog):
    """MXFP4 has no block format in lockstep.kernels: dequantized at load, one log line a type
    (Q4_1 beside it stays in blocks), and served greedy equal to HF on the same (dequantized) weights."""
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))

    def qtype_of(name: str) -> gguf.GGMLQuantizationType:
        return QTYPE.MXFP4 if "ffn" in name else QTYPE.Q4_1

    path = write_gguf(tiny_hf_model("llama"), "llama", tmp_path / "mxfp4.gguf", qtype_of=qtype_of)
    source = resolve_model(str(path))
    with caplog.at_level(logging.INFO, logger="lockstep.model_loader.weights"):
        sched = make_scheduler(path, max_total_tokens=2048, int8_activations=False)
    lines = [r.message for r in caplog.records if "dequantized to float32 at load" in r.message]
    assert len(lines) == 1 and "MXFP4" in lines[0], lines
    prompts = [[1, 10, 200, 7, 42], [1, 99, 150, 3, 60, 61, 62]]
    ref = hf_greedy(source.model_dir, prompts, 12)
    got = run_to_completion(sched, [greedy_req(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    for i, r in enumerate(ref):
        assert greedy_matches(got[f"r{i}"].output_ids, r), i


@pytest.mark.server
@pytest.mark.parametrize("int8", [False, True])
def test_tiny_gguf_tp2_equals_tp1_bitwise(tmp_path, int8):
    """ids and logprobs, with an intermediate size of 3 Q8_0 blocks (no whole-block split of the
    down projection's input exists over 2 ranks), on both activation paths."""
    # the default cache dir: the spawned ranks reuse the compiled kernels (a private cache made
    # each of them compile the kernels again, about 40 s)
    model = tiny_hf_model("qwen3", intermediate_size=96)
    path = write_gguf(model, "qwen3", tmp_path / "q3.gguf", quantize=True)
    prompts = [[1, 10, 200, 7, 42], [1, 99, 150, 3, 60, 61, 62, 63, 64]]
    single = run_to_completion(
        make_scheduler(path, max_total_tokens=2048, int8_activations=int8),
        [greedy_req(f"r{i}", p, 12, return_logprob=True) for i, p in enumerate(prompts)])
    launched = launch_subprocesses(ServerArgs(model_path=str(path), tp_size=2, max_total_tokens=2048,
                                              int8_activations=int8))
    try:
        assert generate_through(launched, prompts, 12, return_logprob=True) == [
            (single[f"r{i}"].output_ids, single[f"r{i}"].logprobs)
            for i in range(len(prompts))]
    finally:
        launched.shutdown()


@pytest.mark.skipif(not compiled("linear_bf16"), reason="--dtype bfloat16 on blocks needs the "
                    "compiled AVX-512 kernels and the CPU flag amx_bf16, which this machine lacks")
def test_bfloat16_serves_blocks_on_amx_batch_invariant_and_close_to_float32(tmp_path, monkeypatch):
    """--dtype bfloat16 on a GGUF: every block linear and the head run the AMX bf16 kernel on the
    blocks (no float copy), a request alone equals itself in a batch bitwise, and greedy output
    starts as float32's does."""
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_hf_model("qwen3"), "qwen3", tmp_path / "q3.gguf", quantize=True)
    calls: list[str] = []
    amx = kernels.linear_bf16

    def spy(x, blocks_, qtype, n_cols):
        calls.append(qtype)
        return amx(x, blocks_, qtype, n_cols)

    monkeypatch.setattr(kernels, "linear_bf16", spy)
    prompts = [[1, 10, 200, 7, 42], [1, 99, 150, 3, 60, 61, 62, 63, 64], [1, 5, 6, 7],
               [1, 300, 301, 2, 9, 9, 9, 11, 12, 13, 14, 15, 16]]
    kw = dict(max_total_tokens=2048, disable_radix_cache=True, chunked_prefill_size=-1)
    sched = make_scheduler(path, dtype="bfloat16", **kw)
    linears = [m for m in sched.worker.runner.model.modules() if hasattr(m, "parts")]
    assert linears and all(m.weight is None for m in linears)
    assert all(isinstance(p, BlockWeight) for m in linears for p in m.parts)

    def run(s, ids: list[int]) -> dict:
        return run_to_completion(s, [greedy_req(f"r{i}", prompts[i], 12, return_logprob=True)
                                     for i in ids])

    batch = run(sched, list(range(len(prompts))))
    assert calls and "Q8_0" in calls
    for i in range(len(prompts)):
        alone = run(sched, [i])[f"r{i}"]
        assert alone.output_ids == batch[f"r{i}"].output_ids, i
        assert alone.logprobs == batch[f"r{i}"].logprobs, i  # exact, not approx
    exact = run(make_scheduler(path, int8_activations=False, **kw), list(range(len(prompts))))
    for i in range(len(prompts)):
        assert batch[f"r{i}"].output_ids[:3] == exact[f"r{i}"].output_ids[:3], i

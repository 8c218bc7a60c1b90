"""`--quantization`: a float checkpoint's linears, embedding table and LM head packed into GGML
blocks at load (q8_0, q4_0, fp16 = F16 blocks), float32 activations. The oracle is HF
transformers with the same weights packed and unpacked, so tokens must match it as exactly as
the float32 path matches plain HF."""

from __future__ import annotations

import pytest
import torch

from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.kernels import compiled, dequantize, quantize
from lockstep.layers import quantization
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.embedding import VocabParallelEmbedding
from lockstep.layers.linear import ColumnParallelLinear, RowParallelLinear
from lockstep.layers.quantization import QUANTIZATION_TYPES
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import generate_through, greedy_req, make_scheduler, run_to_completion
from lockstep.testing.oracle import greedy_matches, hf_greedy, hf_packed_weight_model
from lockstep.testing.tiny_models import TINY_ARCHS, tiny_prompts

MAX_NEW = 24


# Every architecture in q8_0; the other methods on one architecture each (the packing is shared).
@pytest.mark.parametrize("arch, method", [(a, "q8_0") for a in TINY_ARCHS]
                         + [("qwen2", "q4_0"), ("gemma3", "fp16")])
def test_packed_weights_match_an_oracle_with_the_same_rounding(arch, method, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    prompts = tiny_prompts(model_dir, 3, seed=5)
    oracle = hf_packed_weight_model(model_dir, QUANTIZATION_TYPES[method])
    ref = hf_greedy(model_dir, prompts, MAX_NEW, model=oracle)
    # the oracle rounds the weights only: the exact path (float32 activations) is what it checks
    sched = make_scheduler(model_dir, max_total_tokens=4096, quantization=method,
                           int8_activations=False)
    reqs = [greedy_req(f"r{i}", p, MAX_NEW, return_logprob=True) for i, p in enumerate(prompts)]
    got = run_to_completion(sched, reqs)
    for i, r in enumerate(ref):
        assert greedy_matches(got[f"r{i}"].output_ids, r), f"{arch} prompt {i}"
        if got[f"r{i}"].output_ids == r.output_ids:
            assert got[f"r{i}"].logprobs == pytest.approx(r.logprobs, abs=1e-3)
    assert len({t for r in ref for t in r.output_ids}) >= 5, "degenerate oracle output proves nothing"


def _float_weight(linear) -> torch.Tensor:
    """A linear's weight values: its float parameter, or its parts' (blocks dequantized; a float
    checkpoint's float32 rows are F32 parts on the exact kernel)."""
    if linear.parts is None:
        return linear.weight
    return torch.cat([p.dequantize() if isinstance(p, BlockWeight) else p for p in linear.parts])


def test_every_linear_and_the_table_are_packed(tiny_model_dirs):
    """Each weight is the q8_0 blocks of the float one: kept as blocks where a kernel serves
    Q8_0, else their dequantized values; never the float32 original."""
    model_dir = tiny_model_dirs["qwen2"]
    plain = make_scheduler(model_dir, max_total_tokens=1024).worker.runner.model
    packed = make_scheduler(model_dir, max_total_tokens=1024, quantization="q8_0").worker.runner.model
    originals = dict(plain.named_modules())
    checked = 0
    for name, m in packed.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            w = _float_weight(originals[name])
            got = _float_weight(m)
        elif isinstance(m, VocabParallelEmbedding):
            w = originals[name].weight
            assert m.table is not None and m.table.qtype == "Q8_0" and m.weight is None
            got = m.table.dequantize()
        else:
            continue
        assert torch.equal(got, dequantize("Q8_0", quantize("Q8_0", w), w.shape[1])), name
        assert not torch.equal(got, w), name
        checked += 1
    assert checked == 1 + 4 * 4  # the tied table, then qkv / o / gate_up / down of 4 layers


@pytest.mark.server
def test_quantized_tp2_processes_match_a_quantized_single_rank(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    prompts = tiny_prompts(model_dir, 4, seed=8)
    single = run_to_completion(
        make_scheduler(model_dir, max_total_tokens=2048, quantization="q8_0"),
        [greedy_req(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    args = ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=2048,
                      tp_size=2, quantization="q8_0")
    launched = launch_subprocesses(args)
    try:
        assert generate_through(launched, prompts, 12) == [single[f"r{i}"].output_ids
                                                           for i in range(len(prompts))]
    finally:
        launched.shutdown()


@pytest.mark.parametrize("changes, says", [
    ({"device": "cuda"}, "with --device cpu"),
    ({"dtype": "float16"}, "use --dtype auto or float32 instead of --dtype float16"),
])
def test_unsupported_combinations_fail_with_a_clear_message(changes, says):
    with pytest.raises(ValueError, match="--quantization q8_0") as info:
        ServerArgs(quantization="q8_0", **changes)
    assert says in str(info.value)


def test_bfloat16_with_quantization_needs_amx_bf16(monkeypatch):
    """--dtype bfloat16 runs packed weights on the AMX kernels: refused at start, naming the
    missing flag, on a CPU without them; accepted on one with them."""
    monkeypatch.setattr(quantization, "_amx_bf16_lacking", lambda: ["amx_bf16"])
    with pytest.raises(ValueError, match="lacks the flag\\(s\\) amx_bf16: use --dtype auto or "
                                         "float32 instead of --dtype bfloat16"):
        ServerArgs(quantization="q8_0", dtype="bfloat16")
    monkeypatch.setattr(quantization, "_amx_bf16_lacking", lambda: [])
    ServerArgs(quantization="q8_0", dtype="bfloat16")


@pytest.mark.skipif(not compiled("linear_bf16"), reason="the AMX bfloat16 kernels need the CPU "
                    "flag amx_bf16 and the AVX-512 kernels, which this machine lacks")
def test_bfloat16_keeps_packed_blocks_on_amx(tiny_model_dirs):
    model = make_scheduler(tiny_model_dirs["qwen2"], max_total_tokens=1024, quantization="q8_0",
                           dtype="bfloat16").worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(linears) == 16 and all(m.weight is None for m in linears)
    assert all(isinstance(p, BlockWeight) and p.qtype == "Q8_0" for m in linears for p in m.parts)
    table = next(m for m in model.modules() if isinstance(m, VocabParallelEmbedding))
    assert table.weight is None and table.table is not None


def test_auto_dtype_combines_with_quantization():
    ServerArgs(quantization="q4_0", dtype="auto")  # auto is float32 on a CPU


def test_a_gguf_refuses_quantization_at_start(tmp_path, monkeypatch):
    from lockstep.testing.gguf_writer import write_gguf
    from lockstep.testing.tiny_models import tiny_hf_model

    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_gguf(tiny_hf_model("qwen2"), "qwen2", tmp_path / "q.gguf")
    with pytest.raises(ValueError, match="is a GGUF, its weights are quantized blocks already; "
                                         "drop --quantization"):
        make_scheduler(gguf_path, max_total_tokens=1024, quantization="q8_0")

"""`--quantization fp16`: float16 weights in FBGEMM's packed form, float32 compute. The oracle
is HF transformers with the same weights rounded to float16, so tokens must match it as exactly
as the float32 path matches plain HF."""

from __future__ import annotations

import pytest

from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.layers.embedding import VocabParallelEmbedding
from lockstep.layers.linear import ColumnParallelLinear, RowParallelLinear
from lockstep.server_args import ServerArgs
from lockstep.testing.inproc import generate_through, greedy_req, make_scheduler, run_to_completion
from lockstep.testing.oracle import greedy_matches, hf_fp16_weight_model, hf_greedy
from lockstep.testing.tiny_models import TINY_ARCHS
from tests.conftest import tiny_prompts

MAX_NEW = 24


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fp16_weights_match_an_oracle_with_the_same_rounding(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    prompts = tiny_prompts(model_dir, 4, seed=5)
    ref = hf_greedy(model_dir, prompts, MAX_NEW, model=hf_fp16_weight_model(model_dir))
    sched = make_scheduler(model_dir, max_total_tokens=4096, quantization="fp16")
    reqs = [greedy_req(f"r{i}", p, MAX_NEW, return_logprob=True) for i, p in enumerate(prompts)]
    got = run_to_completion(sched, reqs)
    for i, r in enumerate(ref):
        assert greedy_matches(got[f"r{i}"].output_ids, r), f"{arch} prompt {i}"
        if got[f"r{i}"].output_ids == r.output_ids:
            assert got[f"r{i}"].logprobs == pytest.approx(r.logprobs, abs=1e-3)
    assert len({t for r in ref for t in r.output_ids}) >= 5, "degenerate oracle output proves nothing"


def test_every_linear_and_the_lm_head_are_packed_and_float32_linears_dropped(tiny_model_dirs):
    sched = make_scheduler(tiny_model_dirs["qwen2"], max_total_tokens=1024, quantization="fp16")
    model = sched.worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert linears and all(m.packed is not None and m.weight is None for m in linears)
    head = model.lm_head
    assert isinstance(head, VocabParallelEmbedding) and head.logits_packed is not None
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(("proj.weight", "qkv_proj.bias")) for n in names)


def test_quantized_tp2_processes_match_a_quantized_single_rank(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    prompts = tiny_prompts(model_dir, 4, seed=8)
    single = run_to_completion(
        make_scheduler(model_dir, max_total_tokens=2048, quantization="fp16"),
        [greedy_req(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    args = ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=2048,
                      tp_size=2, quantization="fp16")
    launched = launch_subprocesses(args)
    try:
        assert generate_through(launched, prompts, 12) == [single[f"r{i}"].output_ids
                                                           for i in range(len(prompts))]
    finally:
        launched.shutdown()


@pytest.mark.parametrize("changes", [{"device": "cuda"}, {"dtype": "bfloat16"}, {"dtype": "float16"}])
def test_unsupported_combinations_fail_with_a_clear_message(changes):
    with pytest.raises(ValueError, match="--quantization fp16"):
        ServerArgs(quantization="fp16", **changes)

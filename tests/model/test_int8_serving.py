"""`--int8-activations`: the block linears and the LM head on the int8 kernels, at every batch size, so a
request's numbers still do not depend on its batch; contradictions refused at start."""

from __future__ import annotations

import pytest

from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.kernels import compiled
from lockstep.layers.block_weight import BlockWeight, Kind
from lockstep.layers.embedding import VocabParallelEmbedding
from lockstep.layers.linear import ColumnParallelLinear, RowParallelLinear
from lockstep.server_args import ServerArgs
from lockstep.testing.gguf_writer import write_gguf
from lockstep.testing.inproc import generate_through, greedy_req, make_scheduler, run_to_completion
from lockstep.testing.live_server import GEMMA
from lockstep.testing.tiny_models import tiny_hf_model, tiny_prompts


def int8_parts(model) -> list[BlockWeight]:
    parts = []
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            parts += m.parts or []
        elif isinstance(m, VocabParallelEmbedding) and m.logits_parts:
            parts += m.logits_parts
    return [p for p in parts if isinstance(p, BlockWeight) and p.kind is Kind.INT8]


@pytest.mark.real_model
@pytest.mark.skipif(not compiled("linear_int8"), reason="the default runs int8 activations where the int8 "
                    "kernel is compiled; this machine serves the exact path on the torch reference")
def test_gemma_is_int8_batch_invariant_and_near_float32() -> None:
    """Default flags on Gemma 3 270M's GGUF (Q8_0 head, Q5_0 / Q4_K / Q6_K linears): every block matmul
    on int8 activations; a request alone gives the same ids and logprobs, bitwise, as inside a batch
    of 32 of mixed lengths; and first greedy tokens mostly agree with the exact float32 path's."""
    import random

    import torch

    from lockstep.testing.corpus import random_prompt
    from lockstep.testing.inproc import packaged_tokenizer

    rng = random.Random(4)
    prompts = [packaged_tokenizer(GEMMA)(random_prompt(rng, rng.randint(2, 60))).input_ids for _ in range(32)]
    # No prefix cache: a cached prefix is attended by another code path whose float32 sums differ
    # in the last ulp from a full prefill's (on the exact path too); int8 rounding can magnify that.
    sched = make_scheduler(GEMMA, max_total_tokens=8192, disable_radix_cache=True, chunked_prefill_size=-1)
    parts = int8_parts(sched.worker.runner.model)
    # the GGUF's Q8_0 / Q5_0 / Q4_K / Q6_K, as the int8 path serves them (kernels.unpack_for_int8)
    assert {p.qtype for p in parts} == {"Q8_0", "Q5_0_U8", "Q4_K_S8", "Q6_K_U8"}
    # 18 layers x (qkv, o, gate_up, down): fused parts of one type merge; the tied head is the last
    assert len(parts) >= 18 * 4 + 1

    def run(s, ids: list[int], tag: str) -> dict:
        return run_to_completion(s, [greedy_req(f"{tag}{i}", prompts[i], 10, return_logprob=True) for i in ids])

    assert sched.worker.runner.kv_dtype == torch.float16  # the default beside int8 activations
    batched = run(sched, list(range(32)), "b")
    for i in (0, 7, 31):
        alone = run(sched, [i], "a")[f"a{i}"]
        assert alone.output_ids == batched[f"b{i}"].output_ids, i
        assert alone.logprobs == batched[f"b{i}"].logprobs, i  # bitwise: same floats
    exact = run(make_scheduler(GEMMA, max_total_tokens=4096, disable_radix_cache=True, int8_activations=False),
                list(range(12)), "e")
    same_first = sum(exact[f"e{i}"].output_ids[0] == batched[f"b{i}"].output_ids[0] for i in range(12))
    assert same_first >= 10
    # not the exact path's numbers: the default took effect
    assert any(exact[f"e{i}"].logprobs[0] != batched[f"b{i}"].logprobs[0] for i in range(12))


@pytest.mark.server
def test_packed_float_checkpoint_serves_through_processes(tiny_model_dirs) -> None:
    """--quantization q8_0 --int8-activations on an HF checkpoint: the server's processes give the
    same greedy tokens as the in-process scheduler with the same flags."""
    model_dir = tiny_model_dirs["qwen2"]
    prompts = tiny_prompts(model_dir, 3, seed=4)
    sched = make_scheduler(model_dir, max_total_tokens=2048, quantization="q8_0", int8_activations=True)
    assert len(int8_parts(sched.worker.runner.model)) == 1 + 4 * 4
    single = run_to_completion(sched, [greedy_req(f"r{i}", p, 10) for i, p in enumerate(prompts)])
    args = ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=2048,
                      quantization="q8_0", int8_activations=True)
    launched = launch_subprocesses(args)
    try:
        assert generate_through(launched, prompts, 10) == [single[f"r{i}"].output_ids for i in range(3)]
    finally:
        launched.shutdown()


@pytest.mark.parametrize("changes, says", [
    ({"device": "cuda"}, "--int8-activations runs the CPU block kernels: serve it with --device cpu"),
    ({"dtype": "bfloat16"}, "use --dtype auto or float32 instead of --dtype bfloat16"),
    ({"dtype": "float16"}, "use --dtype auto or float32 instead of --dtype float16"),
    ({"quantization": "fp16"}, "--quantization fp16 packs float ones: use --quantization q8_0 or q4_0"),
])
def test_contradictions_are_refused_at_start(changes, says) -> None:
    with pytest.raises(ValueError, match="--int8-activations") as info:
        ServerArgs(int8_activations=True, **changes)
    assert says in str(info.value)


def test_a_float_checkpoint_without_quantization_is_refused(tiny_model_dirs) -> None:
    with pytest.raises(ValueError, match="is a float checkpoint: add --quantization q8_0"):
        make_scheduler(tiny_model_dirs["qwen2"], max_total_tokens=1024, int8_activations=True)


def test_the_flag_on_the_command_line() -> None:
    from lockstep.cli import serve_parser

    parser = serve_parser()
    assert ServerArgs.from_cli_args(parser.parse_args(["--int8-activations"])).int8_activations is True
    assert ServerArgs.from_cli_args(parser.parse_args(["--no-int8-activations"])).int8_activations is False
    assert ServerArgs.from_cli_args(parser.parse_args([])).int8_activations is None  # on where it applies
    assert "docs/benchmarks.md" in parser.format_help()


@pytest.mark.skipif(not compiled("linear_int8"), reason="the default turns int8 on only where a "
                    "compiled int8 kernel serves it; this machine has none")
def test_the_default_is_int8_where_integer_blocks_are(tiny_model_dirs, tmp_path, monkeypatch) -> None:
    """Without the flag: int8 activations on a GGUF and on --quantization q8_0, the exact path on a
    float checkpoint and on --quantization fp16; --no-int8-activations keeps a GGUF exact."""
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_gguf(tiny_hf_model("qwen3"), "qwen3", tmp_path / "q3.gguf", quantize=True)
    float_dir = tiny_model_dirs["qwen2"]

    def n_int8(path, **kw) -> int:
        return len(int8_parts(make_scheduler(path, max_total_tokens=1024, **kw).worker.runner.model))

    assert n_int8(gguf_path) > 0
    assert n_int8(float_dir, quantization="q8_0") == 1 + 4 * 4
    assert n_int8(float_dir) == 0
    assert n_int8(float_dir, quantization="fp16") == 0
    assert n_int8(gguf_path, int8_activations=False) == 0


def test_the_kv_cache_type_follows_the_arithmetic_unless_set(tiny_model_dirs, tmp_path, monkeypatch) -> None:
    """--kv-cache-dtype auto: float16 K/V beside int8 activations (llama.cpp's cache type), float32 on the
    exact path (the HF-equality oracle stays float32 throughout); a set type wins either way, and the
    pool's token budget counts its bytes. Greedy tokens still come out through a float16 pool."""
    import torch

    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    float_dir = tiny_model_dirs["qwen2"]

    def runner(**kw):
        return make_scheduler(float_dir, max_total_tokens=1024, **kw).worker.runner

    def pool_type(r) -> torch.dtype:
        return next(iter(r.token_to_kv_pool.k_buffer.values())).dtype

    exact = runner()
    assert exact.kv_dtype == pool_type(exact) == torch.float32
    assert pool_type(runner(kv_cache_dtype="float16")) == torch.float16
    if compiled("linear_int8"):  # the default turns int8 on only where its kernel is compiled
        r8 = runner(quantization="q8_0")
        assert r8.kv_dtype == pool_type(r8) == torch.float16
        assert pool_type(runner(quantization="q8_0", kv_cache_dtype="float32")) == torch.float32
    sched = make_scheduler(float_dir, max_total_tokens=1024, kv_cache_dtype="bfloat16")
    out = run_to_completion(sched, [greedy_req("r", tiny_prompts(float_dir, 1, seed=2)[0], 6)])["r"]
    assert len(out.output_ids) == 6
    from lockstep.cli import serve_parser

    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--kv-cache-dtype", "int4"])

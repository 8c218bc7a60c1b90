"""LoRA adapters served beside the base model, against HF transformers + PEFT on tiny random
models with random adapters (B non-zero): greedy tokens and logprobs; a request's output the same
bits alone and in a batch mixing adapters and the base; the prefix cache kept apart per adapter;
adapters waiting for a slot; loads that do not fit refused with nothing disturbed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep.kernels import compiled
from lockstep.messages import LoadLoraAdapterReq, UnloadLoraAdapterReq
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.lora_adapters import make_peft_adapter, peft_model
from lockstep.testing.oracle import greedy_matches, hf_greedy, load_hf_model
from lockstep.testing.tiny_models import make_tiny_model, tiny_prompts

NEW = 8
# int8 activations against PEFT over the dequantized base, up to the first differing token: the path's
# own rounding moves a logprob by up to 0.11 here with float32 slots, 0.13 with bfloat16 ones, and int8
# slots add their own (0.24 here; over 16 prompts the mean moved 0.063 -> 0.075, docs/lora.md "Precision")
INT8_LOGPROBS = {torch.float32: 0.2, torch.bfloat16: 0.2, torch.int8: 0.3}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{name: (model dir, adapter dir)}: two adapters of the tiny llama (every linear, rank 8; and
    q/v only, rank 4, rsLoRA) and one of the tiny gemma3."""
    root = tmp_path_factory.mktemp("lora")
    llama, gemma = make_tiny_model("llama"), make_tiny_model("gemma3")
    return {
        "all": (llama, make_peft_adapter(llama, root / "all", seed=1, rank=8, alpha=16)),
        "qv": (llama, make_peft_adapter(llama, root / "qv", seed=2, rank=4, alpha=8,
                                        targets=("q_proj", "v_proj"), use_rslora=True)),
        "gemma": (gemma, make_peft_adapter(gemma, root / "gemma", seed=3, rank=8, alpha=16)),
    }


def _serve(model: Path, adapters: dict[str, tuple[Path, Path]], names: list[str], **kw):
    paths = [f"{n}={adapters[n][1]}" for n in names]
    return make_scheduler(model, max_total_tokens=2048, lora_paths=paths, **kw)


def _req(rid: str, prompt: list[int], lora: str | None, new: int = NEW):
    return greedy_req(rid, prompt, new, return_logprob=True, lora_path=lora)


@pytest.mark.parametrize("arch_adapters", [("all", "qv"), ("gemma",)], ids=["llama", "gemma3"])
def test_outputs_match_peft(adapters, arch_adapters) -> None:
    """Each adapter's greedy tokens and logprobs are PEFT's over HF transformers, the base's
    requests (in the same batch) are the plain model's, and the adapters do change the outputs."""
    model = adapters[arch_adapters[0]][0]
    prompts = tiny_prompts(model, 3, seed=5)
    sched = _serve(model, adapters, list(arch_adapters))
    reqs = [_req(f"{n}-{i}", p, n) for n in (*arch_adapters, None) for i, p in enumerate(prompts)]
    got = run_to_completion(sched, reqs)
    for name in (*arch_adapters, None):
        oracle_model = (peft_model(model, adapters[name][1]) if name else load_hf_model(model))
        expected = hf_greedy(model, prompts, NEW, model=oracle_model)
        for i, exp in enumerate(expected):
            out = got[f"{name}-{i}"]
            assert greedy_matches(out.output_ids, exp), (name, i, out.output_ids, exp.output_ids)
            if out.output_ids == exp.output_ids:
                assert out.logprobs == pytest.approx(exp.logprobs, abs=2e-4), (name, i)
    for name in arch_adapters:
        assert any(got[f"{name}-{i}"].output_ids != got[f"None-{i}"].output_ids
                   for i in range(len(prompts))), f"adapter {name} changed no output"


@pytest.mark.skipif(not compiled("linear"), reason="the base is batch invariant on the exact kernel, where it is compiled")
def test_a_request_is_the_same_alone_and_in_a_mixed_batch(adapters) -> None:
    """Bitwise: one adapter's request alone, then beside requests of the other adapter, the base,
    and its own adapter (prefills and decodes of different lengths in one batch)."""
    model = adapters["all"][0]
    prompts = tiny_prompts(model, 6, seed=9)
    sched = _serve(model, adapters, ["all", "qv"])
    alone = run_to_completion(sched, [_req("x", prompts[0], "all", 12)])["x"]
    sched.flush_cache()
    mixed = run_to_completion(sched, {
        0: [_req("b0", prompts[1], "qv", 12), _req("b1", prompts[2], None, 5)],
        2: [_req("x", prompts[0], "all", 12), _req("b2", prompts[3], "all", 7)],
        3: [_req("b3", prompts[4], "qv", 9), _req("b4", prompts[5], None, 12)]})
    assert mixed["x"].output_ids == alone.output_ids
    assert torch.equal(torch.tensor(mixed["x"].logprobs), torch.tensor(alone.logprobs))


@pytest.mark.skipif(not compiled("decoder_layer"), reason="no compiled one-call layer in this process")
@pytest.mark.parametrize("weights", ["float", "q8_0-int8"])
def test_one_call_layers_run_the_adapters_as_the_modules_do(adapters, weights, tmp_path) -> None:
    """The one-call decoder layer with adapter slots gives the module path's bits: adapters' rows
    and the base's in one batch, prefill and decode; on float weights (the exact path) and on Q8_0
    blocks under int8 activations, where a decode of a few rows runs each linear's adapters inside
    the base matmul's parallel region (csrc/int8.cpp) rather than after it."""
    from lockstep.testing.gguf_writer import write_gguf
    from lockstep.testing.tiny_models import tiny_hf_model

    model = adapters["all"][0]
    prompts = tiny_prompts(model, 2, seed=7)
    if weights == "float":
        served, kw = model, {}
        batch = [(p, n) for p in prompts for n in ("all", "qv", None)]
    else:  # four rows: the one-row kernel's limit is five on AVX-512
        served, kw = write_gguf(tiny_hf_model("llama"), "llama", tmp_path / "q8.gguf", quantize=True), {
            "int8_activations": True}
        batch = [(prompts[0], "all"), (prompts[0], "qv"), (prompts[0], None), (prompts[1], "all")]
    out = {}
    for mode in ("one call", "modules"):
        sched = _serve(served, adapters, ["all", "qv"], **kw)
        runner_model = sched.worker.runner.model
        assert all(p is not None for p in runner_model.one_call_args), "every layer should run in one call"
        if mode == "modules":
            runner_model.one_call_args = [None] * len(runner_model.one_call_args)
        got = run_to_completion(sched, [_req(f"{n}-{i}", p, n) for i, (p, n) in enumerate(batch)])
        out[mode] = {rid: (o.output_ids, o.logprobs) for rid, o in got.items()}
    assert out["one call"] == out["modules"]


def test_the_prefix_cache_is_shared_within_an_adapter_only(adapters) -> None:
    model = adapters["all"][0]
    prompt = tiny_prompts(model, 1, seed=11, min_words=20)[0]
    sched = _serve(model, adapters, ["all", "qv"])
    first = run_to_completion(sched, [_req("a1", prompt, "all")])["a1"]
    again = run_to_completion(sched, [_req("a2", prompt, "all")])["a2"]
    other = run_to_completion(sched, [_req("q1", prompt, "qv")])["q1"]
    base = run_to_completion(sched, [_req("b1", prompt, None)])["b1"]
    assert first.cached_tokens == 0 and again.cached_tokens > len(prompt) // 2
    assert again.output_ids == first.output_ids
    assert other.cached_tokens == 0 and base.cached_tokens == 0
    # and with the cache, the other adapter's output is its own (as it is from a fresh server)
    fresh = run_to_completion(_serve(model, adapters, ["qv"]), [_req("q", prompt, "qv")])["q"]
    assert other.output_ids == fresh.output_ids


def test_requests_wait_for_a_resident_slot(adapters) -> None:
    """One slot and two adapters: every request finishes, each with its adapter's output."""
    model = adapters["all"][0]
    prompts = tiny_prompts(model, 4, seed=13)
    names = ["all", "qv", "all", "qv"]
    roomy = run_to_completion(_serve(model, adapters, ["all", "qv"]),
                              [_req(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, names))])
    sched = _serve(model, adapters, ["all", "qv"], max_loras_per_batch=1)
    tight = run_to_completion(sched, [_req(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, names))])
    for rid, out in roomy.items():
        assert tight[rid].output_ids == out.output_ids
        assert tight[rid].finish_reason.type == "length"


def test_loads_that_do_not_fit_are_refused_and_disturb_nothing(adapters, tmp_path) -> None:
    model = adapters["all"][0]
    prompt = tiny_prompts(model, 1, seed=17)[0]
    sched = _serve(model, adapters, ["qv"])  # rank 4, q/v: the server's limits
    before = run_to_completion(sched, [_req("a", prompt, "qv")])["a"]
    big = make_peft_adapter(model, tmp_path / "big", seed=4, rank=8, targets=("q_proj",))
    mlp = make_peft_adapter(model, tmp_path / "mlp", seed=5, rank=4, targets=("down_proj",))
    sched.step([LoadLoraAdapterReq("big", str(big)), LoadLoraAdapterReq("mlp", str(mlp)),
                LoadLoraAdapterReq("nothing", str(tmp_path / "missing"))])
    replies = sched.control_replies[-3:]
    assert [r.status for r in replies] == [400, 400, 400]
    assert "rank 8" in replies[0].message and "--max-lora-rank 4" in replies[0].message
    assert "down_proj" in replies[1].message and "--lora-target-modules" in replies[1].message
    assert "not a directory" in replies[2].message
    assert replies[-1].adapters == {"qv": str(adapters["qv"][1])}
    after = run_to_completion(sched, [_req("b", prompt, "qv"), _req("u", prompt, "nope")])
    assert after["b"].output_ids == before.output_ids
    assert after["u"].finish_reason.status_code == 404 and "'nope'" in after["u"].finish_reason.message
    # a fitting one loads at run time and serves; unloaded, its name is refused again
    ok = make_peft_adapter(model, tmp_path / "ok", seed=6, rank=4, targets=("v_proj",))
    sched.step([LoadLoraAdapterReq("ok", str(ok))])
    assert sched.control_replies[-1].success
    served = run_to_completion(sched, [_req("c", prompt, "ok")])["c"]
    expected = hf_greedy(model, [prompt], NEW, model=peft_model(model, ok))[0]
    assert greedy_matches(served.output_ids, expected)
    sched.step([UnloadLoraAdapterReq("ok"), UnloadLoraAdapterReq("ok")])
    assert [r.status for r in sched.control_replies[-2:]] == [200, 404]
    gone = run_to_completion(sched, [_req("d", prompt, "ok")])["d"]
    assert gone.finish_reason.status_code == 404


@pytest.mark.skipif(not compiled("linear"), reason="blocks stay blocks where a block kernel is compiled")
@pytest.mark.parametrize(("int8", "lora_dtype"), [(False, "auto"), (True, "auto"), (True, "bfloat16")],
                         ids=["exact", "int8", "int8-bfloat16-slots"])
def test_an_adapter_over_block_quantized_weights(adapters, tmp_path, int8, lora_dtype) -> None:
    """The base stays in its Q8_0 blocks (the exact kernel reads them, or the int8 one, the default)
    and the adapter runs beside them: PEFT's output over the same weights dequantized to floats.
    Under int8 activations the slots are int8 (lora/layers.slot_dtype), and a request is the
    same bits alone and beside others."""
    from lockstep.layers.block_weight import BlockWeight
    from lockstep.model_loader import resolve_model
    from lockstep.testing.gguf_writer import write_gguf
    from lockstep.testing.hf_weights import hf_float_model
    from lockstep.testing.tiny_models import tiny_hf_model

    model_dir, adapter = adapters["all"]
    gguf_path = write_gguf(tiny_hf_model("llama"), "llama", tmp_path / "q8.gguf", quantize=True)
    sched = make_scheduler(gguf_path, max_total_tokens=2048, lora_paths=[f"all={adapter}"],
                           int8_activations=int8, lora_dtype=lora_dtype)
    qkv = sched.worker.runner.model.layers[0].self_attn.qkv_proj
    slots = {"auto": torch.int8 if int8 else torch.float32, "bfloat16": torch.bfloat16}[lora_dtype]
    assert qkv.lora.a.dtype == slots
    assert qkv.parts and all(isinstance(p, BlockWeight) and p.qtype.value == "Q8_0" for p in qkv.parts)
    prompts = tiny_prompts(model_dir, 3, seed=19)
    got = run_to_completion(sched, [_req(f"r{i}", p, "all") for i, p in enumerate(prompts)])
    entry = resolve_model(str(gguf_path)).model_dir  # the GGUF's cache entry: its blocks dequantized
    expected = hf_greedy(model_dir, prompts, NEW, model=peft_model(model_dir, adapter, base=hf_float_model(entry)))
    plain = hf_greedy(model_dir, prompts, NEW, model=hf_float_model(entry))
    for i, exp in enumerate(expected):
        out = got[f"r{i}"]
        if int8:  # int8 activations part from float32 greedy on these strong random adapters (float32 slots too)
            agree = next((j for j, (a, b) in enumerate(zip(out.output_ids, exp.output_ids)) if a != b), NEW)
            assert out.logprobs[:agree] == pytest.approx(exp.logprobs[:agree], abs=INT8_LOGPROBS[slots]), i
            continue
        assert greedy_matches(out.output_ids, exp), (i, out.output_ids, exp.output_ids)
        if out.output_ids == exp.output_ids:
            assert out.logprobs == pytest.approx(exp.logprobs, abs=2e-4)
    assert any(got[f"r{i}"].output_ids != p.output_ids for i, p in enumerate(plain))
    if int8:
        sched.flush_cache()
        alone = run_to_completion(sched, [_req("x", prompts[0], "all")])["x"]
        assert alone.output_ids == got["r0"].output_ids
        assert torch.equal(torch.tensor(alone.logprobs), torch.tensor(got["r0"].logprobs))


@pytest.mark.skipif(not compiled("linear"), reason="the base is batch invariant on the exact kernel, where it is compiled")
@pytest.mark.parametrize("changes", [{"speculative_algorithm": "NONE"}, {"enable_overlap_schedule": True},
                                     {"chunked_prefill_size": 8, "enable_mixed_chunk": True}],
                         ids=["no-speculation", "overlap", "chunked-mixed"])
def test_adapters_give_the_same_bits_under_other_schedules(adapters, changes) -> None:
    """Speculation (the default on a CPU) against plain decoding, the overlap loop, chunked prefills
    mixed with decodes: the adapters' and the base's outputs do not change. A grammar constrains an
    adapter's output as it does the base's."""
    model = adapters["all"][0]
    prompts = tiny_prompts(model, 4, seed=23, min_words=12)
    loras = ["all", "qv", None, "all"]
    reqs = lambda: [_req(f"r{i}", p, n, 10) for i, (p, n) in enumerate(zip(prompts, loras))]  # noqa: E731
    default = run_to_completion(_serve(model, adapters, ["all", "qv"]), reqs())
    other = run_to_completion(_serve(model, adapters, ["all", "qv"], **changes), reqs())
    for rid, out in default.items():
        assert other[rid].output_ids == out.output_ids, rid
        assert torch.equal(torch.tensor(other[rid].logprobs), torch.tensor(out.logprobs)), rid
    sched = _serve(model, adapters, ["all"], **changes)
    constrained = run_to_completion(sched, [greedy_req("g", prompts[0], 12, regex="(ab|cd){2,4}x",
                                                       lora_path="all", ignore_eos=False)])["g"]
    import re

    assert re.fullmatch("(ab|cd){2,4}x", sched.tokenizer.decode(constrained.output_ids))


@pytest.mark.parametrize("name", ["all", "gemma"])
def test_a_gguf_lora_file_serves_as_its_peft_directory(adapters, name, tmp_path) -> None:
    """llama.cpp's LoRA GGUF of an adapter (Llama's q/k rows permuted as llama.cpp permutes them)
    gives the PEFT directory's outputs bit for bit (float32 tensors), and close ones in float16
    (these random adapters are strong: float16 rounding moves logprobs by up to a tenth)."""
    from lockstep.configs.model_config import ModelConfig
    from lockstep.model_loader import resolve_model
    from lockstep.testing.lora_adapters import write_gguf_lora

    model, adapter = adapters[name]
    cfg = ModelConfig.from_hf(resolve_model(str(model)).hf_config)
    f32 = write_gguf_lora(adapter, cfg.arch, cfg, tmp_path / "a.gguf")
    f16 = write_gguf_lora(adapter, cfg.arch, cfg, tmp_path / "a16.gguf", f16=True)
    prompts = tiny_prompts(model, 3, seed=29)
    sched = make_scheduler(model, max_total_tokens=2048,
                           lora_paths=[f"dir={adapter}", f"f32={f32}", f"f16={f16}"])
    got = run_to_completion(sched, [_req(f"{n}{i}", p, n) for n in ("dir", "f32", "f16")
                                    for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert got[f"f32{i}"].output_ids == got[f"dir{i}"].output_ids
        assert got[f"f32{i}"].logprobs == got[f"dir{i}"].logprobs
        assert got[f"f16{i}"].logprobs == pytest.approx(got[f"dir{i}"].logprobs, abs=0.25)  # rounded B, amplified


def test_int8_slots_round_each_shard_as_the_whole_module() -> None:
    """int8 slots: A's rows and B's columns each to 8 bits with a scale of its own, which bring them
    back within half a step; a tensor-parallel shard of B (the rows its base weight keeps) holds
    exactly the whole module's int8 values and scales for those rows, since B's scales come from its
    whole columns."""
    from lockstep.lora.layers import LoraBatch, LoraLinear

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 64, generator=g), torch.randn(32, 4, generator=g) * 0.1  # rank 4, 32 outputs

    def slots(rows: tuple[int, int]) -> LoraLinear:
        out = rows[1] - rows[0]
        lin = LoraLinear(("o_proj",), [rows], LoraBatch(), torch.zeros(1, 4, 64, dtype=torch.int8),
                         torch.zeros(1, 4, out, dtype=torch.int8), torch.ones(1, 4))
        lin.set_slot(0, [(a, b)])
        return lin

    whole, shard = slots((0, 32)), slots((16, 32))
    assert torch.equal(shard.a, whole.a) and torch.equal(shard.scales, whole.scales)
    assert torch.equal(shard.b[0], whole.b[0, :, 16:32])
    sa, sb = a.abs().amax(1) / 127, b.abs().amax(0) / 127  # what the scales are made of
    torch.testing.assert_close(whole.scales[0], sa * sb)
    assert ((whole.a[0].float() * sa[:, None] - a).abs() <= sa[:, None] / 2 * (1 + 1e-6)).all()
    assert ((whole.b[0].float() * sb[:, None] - b.T).abs() <= sb[:, None] / 2 * (1 + 1e-6)).all()

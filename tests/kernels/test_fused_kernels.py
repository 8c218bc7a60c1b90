"""lockstep.kernels' row-wise ops: the compiled norms, rotary and gated activations of every variant this CPU
runs against float64 references, bitwise batch invariance, and the torch fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lockstep import kernels as fused
from lockstep.kernels import BlockType, ops
from lockstep.kernels.dispatch import build_table
from lockstep.testing.kernels import compiled, variant_params


def rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def close(y: torch.Tensor, ref: torch.Tensor, atol: float = 2e-6) -> None:
    # a few float32 ulps of the values, against a float64 oracle
    assert y.dtype == torch.float32 and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref.double(), rtol=2e-6, atol=atol)


def rows_alone_equal(run, x: torch.Tensor) -> None:
    y = run(x)
    for i in (0, x.shape[0] // 2, x.shape[0] - 1):
        assert torch.equal(run(x[i:i + 1].clone())[0], y[i]), f"row {i} differs alone vs in a batch"


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("d", [640, 256, 80, 1000])  # Gemma hidden, head dim, tails past 32 and 16
def test_rms_norm_and_residual_step(variant: str, d: int) -> None:
    mod = compiled(variant)
    g = torch.Generator().manual_seed(d)
    h, x = torch.randn(67, d, generator=g) * 3, torch.randn(67, d, generator=g) * 50
    wx, wy = 1 + torch.randn(d, generator=g) * 0.3, 1 + torch.randn(d, generator=g) * 0.3
    eps = 1e-6
    close(mod.rms_norm(x, wy, eps), rms64(x, wy, eps), atol=1e-5)
    rows_alone_equal(lambda a: mod.rms_norm(a, wy, eps), x)
    h2, y = mod.add_rms_norm(h, x, wx, wy, eps)
    ref_h2 = h.double() + rms64(x, wx, eps)
    close(h2, ref_h2, atol=1e-5)
    close(y, rms64(h2, wy, eps), atol=1e-5)
    rows_alone_equal(lambda a: torch.cat(mod.add_rms_norm(a[:, :d], a[:, d:], wx, wy, eps), 1),
                     torch.cat([h, x], 1))
    h3, none = mod.add_rms_norm(h, x, None, None, eps)  # a plain residual add
    assert torch.equal(h3, h + x) and none is None
    # a strided row view (a slice of wider rows) is read as it lies
    wide = torch.randn(5, 2 * d, generator=g)
    assert torch.equal(mod.rms_norm(wide[:, :d], wy, eps), mod.rms_norm(wide[:, :d].contiguous(), wy, eps))


@pytest.mark.parametrize("variant", variant_params())
def test_rows_split_over_threads_equal_rows_alone(variant: str) -> None:
    """Prefill-sized inputs fork over threads (decode-sized ones do not): each row the same either way."""
    mod = compiled(variant)
    g = torch.Generator().manual_seed(9)
    x, h, w = torch.randn(4000, 96, generator=g), torch.randn(4000, 96, generator=g), torch.rand(96) + 0.5
    rows_alone_equal(lambda a: mod.rms_norm(a, w, 1e-6), x)
    rows_alone_equal(lambda a: mod.add_rms_norm(a[:, :96], a[:, 96:], w, w, 1e-6)[1], torch.cat([h, x], 1))
    rows_alone_equal(lambda a: mod.act_and_mul(a, "gelu_tanh"), torch.cat([h, x], 1))


def rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return fused.rotate(x.double(), cos.double(), sin.double())


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope(variant: str, qk_norm: bool) -> None:
    mod = compiled(variant)
    hq, hk, d, t = 4, 1, 256, 9
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g) * 4
    pos = torch.tensor([0, 1, 2, 50, 51, 900, 4000, 3, 31999], dtype=torch.float32)
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    qw = 1 + torch.randn(d, generator=g) * 0.2 if qk_norm else None
    kw = 1 + torch.randn(d, generator=g) * 0.2 if qk_norm else None
    out = qkv.clone()
    mod.qk_norm_rope(out, hq, hk, d, qw, kw, cos, sin, 1e-6)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    if qk_norm:
        q, k = rms64(q, qw, 1e-6), rms64(k, kw, 1e-6)
    close(out[:, :hq * d], rope64(q, cos, sin).reshape(t, -1), atol=1e-5)
    close(out[:, hq * d:(hq + hk) * d], rope64(k, cos, sin).reshape(t, -1), atol=1e-5)
    assert torch.equal(out[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])  # v untouched
    if not qk_norm:  # rotation alone rounds exactly as the torch reference does
        assert torch.equal(out[:, :hq * d], fused.rotate(qkv[:, :hq * d].view(t, hq, d), cos, sin).reshape(t, -1))

    def run(a: torch.Tensor) -> torch.Tensor:
        r = a.clone()
        n = r.shape[0]
        mod.qk_norm_rope(r, hq, hk, d, qw, kw, cos[:n].clone() if n < t else cos, sin[:n] if n < t else sin, 1e-6)
        return r

    assert torch.equal(run(qkv[:1]), out[:1])  # the first row alone equals that row in the batch


@pytest.mark.parametrize("variant", variant_params())
@pytest.mark.parametrize("act", fused.COMPILED_ACTS)
def test_act_and_mul(variant: str, act: str) -> None:
    mod = compiled(variant)
    g = torch.Generator().manual_seed(3)
    inter = 2048 + 5  # a tail past the last 16
    gate = torch.cat([torch.linspace(-30, 30, 4001), torch.randn(33 * inter - 4001, generator=g) * 3])
    gate_up = torch.cat([gate.view(33, inter), torch.randn(33, inter, generator=g)], 1)
    y = mod.act_and_mul(gate_up, act)
    gd, up = gate_up.double().chunk(2, -1)
    ref = (F.gelu(gd, approximate="tanh") if act == "gelu_tanh" else F.silu(gd)) * up
    close(y, ref, atol=1e-6)
    rows_alone_equal(lambda a: mod.act_and_mul(a, act), gate_up)


def test_variants_agree_bitwise() -> None:
    from lockstep.kernels.build import missing_flags

    if missing_flags("avx512"):
        pytest.skip(f"this CPU lacks {', '.join(missing_flags('avx512'))} for avx512")
    a, b = compiled("avx2"), compiled("avx512")
    x, w = torch.randn(7, 1000) * 9, torch.rand(1000) + 0.5
    assert torch.equal(a.rms_norm(x, w, 1e-6), b.rms_norm(x, w, 1e-6))
    assert torch.equal(a.act_and_mul(x, "gelu_tanh"), b.act_and_mul(x, "gelu_tanh"))
    assert torch.equal(a.act_and_mul(x, "silu"), b.act_and_mul(x, "silu"))
    qkv, cs = torch.randn(3, 6 * 128), torch.rand(3, 128)
    ra, rb = qkv.clone(), qkv.clone()
    a.qk_norm_rope(ra, 4, 1, 128, w[:128], w[128:256], cs, cs, 1e-6)
    b.qk_norm_rope(rb, 4, 1, 128, w[:128], w[128:256], cs, cs, 1e-6)
    assert torch.equal(ra, rb)


def test_torch_fallback_matches_the_compiled_ops(monkeypatch) -> None:
    """Where no variant is built, the same API serves the torch reference with the same numbers
    (up to float rounding), so a model runs either way."""
    g = torch.Generator().manual_seed(4)
    h, x, w = torch.randn(5, 640, generator=g), torch.randn(5, 640, generator=g), torch.rand(640) + 0.5
    qkv, cs = torch.randn(5, 6 * 256, generator=g), torch.rand(5, 256, generator=g)
    gate_up = torch.randn(5, 4096, generator=g) * 3

    def run() -> list[torch.Tensor]:
        q, k, v = fused.qk_norm_rope(qkv.clone(), 4, 1, 256, w[:256], w[256:512], cs, cs, 1e-6)
        return [fused.rms_norm(x, w, 1e-6), *fused.add_rms_norm(h, x, w, w, 1e-6), q, k, v,
                fused.act_and_mul(gate_up, "gelu_tanh"), fused.act_and_mul(gate_up, "silu")]

    served = run()
    monkeypatch.setattr(ops, "table", lambda: build_table("torch", None))
    for a, b in zip(served, run()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="not one of"):
        fused.act_and_mul(gate_up, "relu")


@pytest.mark.parametrize("variant", variant_params())
def test_linear_parts_of_mixed_types_equal_each_part_alone(variant: str) -> None:
    """A fused layer's parts of different block types (Gemma's q/k Q5_0 beside v Q8_0) in one call:
    each output column bitwise as that part's own `linear` gives it, at every M path."""
    from lockstep.kernels import kernel_variant, linear_parts
    from lockstep.testing.kernels import random_blocks

    mod = compiled(variant)
    k = 768  # whole blocks of 32 and of 256
    parts = [(random_blocks(q, n, k, seed=n), q) for q, n in (("Q5_0", 37), ("Q8_0", 5), ("Q4_K", 11),
                                                               ("Q6_K", 3))]
    blocks, qtypes = [b for b, _ in parts], [q for _, q in parts]
    x = torch.randn(9, k)
    for m in (1, 2, 3, 4, 5, 9):
        xm = x[:m].contiguous()
        y = mod.linear_parts(xm, blocks, qtypes, k)
        assert torch.equal(y, torch.cat([mod.linear(xm, b, q, k) for b, q in parts], 1)), m
        assert torch.equal(y[:1], mod.linear_parts(x[:1].contiguous(), blocks, qtypes, k))
    # the public API serves the selected variant: the same numbers as part-by-part `linear`
    if kernel_variant() == variant:
        want = torch.cat([mod.linear(x[:2], b, q, k) for b, q in parts], 1)
        assert torch.equal(linear_parts(x[:2], [(b, BlockType(q)) for b, q in parts], k), want)


@pytest.mark.skipif(not fused.compiled("decoder_layer"), reason="no compiled kernels in this process")
@pytest.mark.parametrize("arch,weights", [("llama", "hf float32"), ("qwen2", "hf float32"),
                                          ("qwen3", "gguf, int8 activations"), ("gemma3", "gguf, int8 activations"),
                                          ("gemma3", "gguf, float32 activations"), ("qwen2", "gguf, int8 activations")])
def test_one_call_layers_equal_the_modules_bitwise(arch: str, weights: str, tiny_model_dirs, tmp_path) -> None:
    """kernels.decoder_layer runs a layer's ops in the modules' order: ids and logprobs of prefill and
    decode steps are bitwise those of the module path (Gemma's four norms, Qwen2's qkv bias, Qwen3's
    q/k norms, a tied head; the layer's own float weights, block parts on both activation paths)."""
    from lockstep.testing.gguf_writer import write_gguf
    from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
    from lockstep.testing.tiny_models import tiny_hf_model

    path = tiny_model_dirs[arch]
    if weights.startswith("gguf"):
        path = write_gguf(tiny_hf_model(arch), arch, tmp_path / "m.gguf", quantize=True)
    prompts = [[1, 10, 200, 7, 42], [1, 99, 150, 3, 60, 61, 62, 63, 64]]
    out = {}
    for mode in ("one call", "modules"):
        sched = make_scheduler(path, max_total_tokens=2048, int8_activations="int8" in weights)
        model = sched.worker.runner.model
        assert all(a is not None for a in model.one_call_args), "every layer should run in one call"
        if mode == "modules":
            model.one_call_args = [None] * len(model.one_call_args)
        res = run_to_completion(sched, [greedy_req(f"r{i}", p, 10, return_logprob=True)
                                        for i, p in enumerate(prompts)])
        out[mode] = [(res[f"r{i}"].output_ids, res[f"r{i}"].logprobs) for i in range(len(prompts))]
    assert out["one call"] == out["modules"]

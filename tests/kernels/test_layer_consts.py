"""The one-call decoder layer's arguments cross the Python/C++ boundary by name: the constants as
kernels.LayerConsts (csrc/ops.h LOCKSTEP_LAYER_CONSTS), the per-step arguments as keywords, the
parts' kinds as the weight plan's names. These fail when the two sides disagree on a name, whatever
the positions."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields

import pytest
import torch

from lockstep import kernels
from lockstep.kernels import LayerConsts, reference
from lockstep.kernels.dispatch import table
from lockstep.kernels.layer_consts import PART_KINDS
from lockstep.layers.block_weight import Kind
from lockstep.testing.inproc import make_scheduler
from lockstep.testing.kernels import compiled, variant_params


def _params(doc: str, op: str) -> list[str]:
    """Parameter names of a pybind11 function from its docstring's signature line."""
    line = next(s for s in doc.splitlines() if s.startswith(f"{op}("))
    return re.findall(r"(\w+): ", line[len(op) + 1:line.rindex(")")])


@pytest.fixture(scope="module")
def consts(tiny_model_dirs) -> list[LayerConsts]:
    """The first layer's constants of a Qwen2 (qkv bias) and a Gemma 3 (four norms, q/k norms)."""
    if not kernels.compiled("decoder_layer"):
        pytest.skip("no compiled kernels in this process")
    out = []
    for arch in ("qwen2", "gemma3"):
        model = make_scheduler(tiny_model_dirs[arch], max_total_tokens=1024).worker.runner.model
        out.append(model.one_call_args[0].consts)
    return out


@pytest.mark.parametrize("variant", variant_params())
def test_the_names_agree_on_both_sides(variant: str) -> None:
    mod = compiled(variant).mod
    assert mod.LayerConsts.fields == tuple(f.name for f in fields(LayerConsts))
    assert mod.LayerConsts.part_kinds == PART_KINDS
    assert set(PART_KINDS) <= {k.value for k in Kind}  # the plan's kinds, by their names
    python = list(inspect.signature(kernels.decoder_layer).parameters)
    assert _params(mod.decoder_layer.__doc__, "decoder_layer") == python
    assert list(inspect.signature(reference.decoder_layer).parameters) == python


@pytest.mark.parametrize("variant", variant_params())
def test_a_name_the_other_side_lacks_is_refused_by_name(variant: str, consts: list[LayerConsts]) -> None:
    mod = compiled(variant).mod
    named = consts[0].named()
    mod.LayerConsts(**named)  # as the Python side fills it
    renamed = dict(named)
    renamed["n_heads"] = renamed.pop("n_q")
    with pytest.raises(TypeError, match="missing field 'n_q'"):
        mod.LayerConsts(**renamed)
    with pytest.raises(TypeError, match="unknown field.*softcapping"):
        mod.LayerConsts(**named, softcapping=0.0)
    with pytest.raises(ValueError, match="no part kind 'amx_bf16'"):
        mod.LayerConsts(**{**named, "kinds": ["amx_bf16"] * len(named["kinds"])})
    with pytest.raises(TypeError):  # per-step arguments are keywords too
        mod.decoder_layer(h=torch.zeros(1, 64), consts=mod.LayerConsts(**named))


def test_the_compiled_layer_agrees_with_its_reference(consts: list[LayerConsts]) -> None:
    """kernels.decoder_layer through the table (compiled) and reference.decoder_layer (the same ops
    on their torch references) on prefill rows: the same K/V written, outputs to float rounding."""
    torch.manual_seed(3)
    for c in consts:
        t, d = 7, c.head_dim
        h = torch.randn(t, c.in_features[0])
        cos, sin = torch.randn(t, d), torch.randn(t, d)
        slots = torch.arange(t)
        args = (slots, slots, torch.zeros(t, dtype=torch.int64), torch.arange(1, t + 1))
        bufs = [[torch.zeros(16, c.n_kv, d) for _ in range(2)] for _ in range(2)]
        got = table().decoder_layer.compiled(h, c, cos, sin, *bufs[0], *args)
        want = reference.decoder_layer(h, c, cos, sin, *bufs[1], *args)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(bufs[0], bufs[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

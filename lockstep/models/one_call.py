"""One compiled call per decoder layer (kernels.decoder_layer, csrc/layer.cpp) where the layer runs on
the CPU in float32 on one tensor-parallel rank: the ops its modules run one by one, in their order,
with the layer's constant arguments gathered once. The module path stays the reference (and serves
GPUs, other dtypes, TP ranks, head sizes and activations the kernels do not take)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep import kernels
from lockstep.forward_batch import ForwardBatch
from lockstep.layers.activation import COMPILED_ACT
from lockstep.layers.block_weight import BlockWeight
from lockstep.mem_cache.memory_pool import TokenToKVPool

OWN_WEIGHT, FLOAT_PART = -2, -1  # layer.cpp's part types besides GGML block type ids


def _linear(lin: nn.Module) -> tuple[list[torch.Tensor], list[int], list[int]] | None:
    """A linear's weights, part types and int8 flags as layer.cpp takes them; None where a part is
    one its kernels would not take (then the modules run)."""
    if lin.parts is None:
        return [lin.weight], [OWN_WEIGHT], [0]
    w, types, int8 = [], [], []
    for p in lin.parts:
        if isinstance(p, BlockWeight):
            op = "linear_int8" if p.int8_activations else "linear"
            if p.n_cols % 32 or not kernels.compiled(op):
                return None
            w.append(p.blocks)
            types.append(p.qtype.code)
            int8.append(int(p.int8_activations))
        else:
            w.append(p)
            types.append(FLOAT_PART)
            int8.append(0)
    return w, types, int8


@dataclass(frozen=True)
class Plan:
    """A layer's constant arguments of kernels.decoder_layer, gathered once: a step then looks up
    nothing on the modules (a few microseconds a layer, 18 layers a step)."""

    weights: tuple[Any, ...]  # the arguments after h, before cos and sin
    rope_key: str
    layer_id: int  # its KV buffers in the pool
    attention: tuple[Any, ...]  # the arguments after the attention metadata: scaling, softcap, window, act


def plan(layer: nn.Module) -> Plan | None:
    """The layer's constant arguments of kernels.decoder_layer, or None where the modules must run."""
    attn, mlp = layer.self_attn, layer.mlp
    mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if (not kernels.compiled("decoder_layer") or mlp.down_proj.tp.size != 1 or attn.head_dim % 16
            or mlp.act not in COMPILED_ACT or mods[0]._dtype != torch.float32
            or mods[0]._device.type != "cpu"):
        return None
    linears = [_linear(m) for m in mods]
    if any(x is None for x in linears):
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.gemma_norms:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    weights = ([n.scale for n in norms], norms[0].eps,
               [w for ws, _, _ in linears for w in ws], [t for _, ts, _ in linears for t in ts],
               [i for _, _, i8 in linears for i in i8], [len(ws) for ws, _, _ in linears],
               [m.in_features for m in mods],
               attn.qkv_proj.bias, attn.n_heads, attn.n_kv, attn.head_dim,
               attn.q_norm.scale if attn.qk_norm else None, attn.k_norm.scale if attn.qk_norm else None,
               attn.q_norm.eps if attn.qk_norm else 0.0)
    core = attn.attn
    return Plan(weights, attn.rope_key, core.layer_id,
                (core.scaling, core.softcap or 0.0, core.window or 0, COMPILED_ACT[mlp.act]))


def forward(p: Plan, h: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool,
            rope: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    meta = fb.attn
    assert meta is not None, "ForwardBatch.build_attention must run before the model"
    cos, sin = rope[p.rope_key]
    return kernels.decoder_layer(h, *p.weights, cos, sin, pool.k_buffer[p.layer_id], pool.v_buffer[p.layer_id],
                                 fb.out_cache_loc, meta.kv_flat, meta.row_kv_starts, meta.row_kv_lens, *p.attention)

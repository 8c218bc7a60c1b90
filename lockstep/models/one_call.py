"""One compiled call per decoder layer (kernels.decoder_layer, csrc/layer.cpp) where the layer runs on
the CPU in float32 on one tensor-parallel rank: the ops its modules run one by one, in their order,
with the layer's constants gathered once, by name (kernels.LayerConsts). The module path stays the
reference (and serves GPUs, other dtypes, TP ranks, head sizes and activations the kernels do not
take). The parts' kinds are the weight plan's (layers/weight_plan.py), read here, not decided again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep import kernels
from lockstep.forward_batch import ForwardBatch
from lockstep.kernels import BlockType, LayerConsts
from lockstep.layers.activation import COMPILED_ACT
from lockstep.layers.block_weight import BlockWeight, Kind, part_kind
from lockstep.mem_cache.memory_pool import TokenToKVPool

# the kernel each kind's parts run on in the layer, which must be compiled here for it to run in one call
_KIND_OPS = {Kind.EXACT: "linear", Kind.INT8: "linear_int8", Kind.FLOAT: None}


def _linear(lin: nn.Module) -> tuple[list[torch.Tensor], list[str], list[int]] | None:
    """A linear's weights, part kinds and block type ids as LayerConsts holds them; None where a part
    is of a kind the one-call layer does not run here (then the modules run)."""
    parts = [lin.weight] if lin.parts is None else lin.parts
    weights, kinds, types = [], [], []
    for p in parts:
        kind = part_kind(p)
        if kind not in _KIND_OPS or (_KIND_OPS[kind] and not kernels.compiled(_KIND_OPS[kind])):
            return None
        if isinstance(p, BlockWeight):
            weights.append(p.blocks)
            types.append(p.qtype.code)
        else:
            if p.dtype != torch.float32:
                return None
            weights.append(p)
            types.append(BlockType.F32.code)  # float32 rows: F32's layout (the type id is not read)
        kinds.append(kind.value)
    return weights, kinds, types


@dataclass(frozen=True)
class Plan:
    """A layer's constants for kernels.decoder_layer, gathered once: a step then looks up nothing
    on the modules (a few microseconds a layer, every layer every step)."""

    consts: LayerConsts
    rope_key: str
    layer_id: int  # its KV buffers in the pool
    lora: Any = None  # the model's lora.layers.LoraBatch (each row's adapter slot), where it has adapters


def _lora_fits(lora: Any, lin: nn.Module) -> bool:
    """Whether the layer's kernel runs this linear's LoRA products (lora.layers.LoraLinear, None
    where it has no adapter slots) as its module would: on the compiled lora_sgmv."""
    return lora is None or (kernels.compiled("lora_sgmv") and lin.in_features % kernels.GROUP == 0
                            and lora.a.dtype in kernels.LORA_SLOT_TYPES and lora.a.device.type == "cpu")


def _lora_consts(loras: list[Any]) -> dict[str, list]:
    """LayerConsts' lora_* fields: none without adapter slots, else one per linear (empty: none)."""
    if all(lo is None for lo in loras):
        return {}
    none = torch.empty(0)
    return {"lora_a": [none if lo is None else lo.a for lo in loras],
            "lora_b": [none if lo is None else lo.b for lo in loras],
            "lora_scales": [none if lo is None else lo.scales for lo in loras],
            "lora_ranks": [none if lo is None else lo.ranks for lo in loras],
            "lora_splits": [[] if lo is None else lo.splits for lo in loras]}


def plan(layer: nn.Module) -> Plan | None:
    """The layer's constants for kernels.decoder_layer, or None where the modules must run."""
    attn, mlp = layer.self_attn, layer.mlp
    mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if (not kernels.compiled("decoder_layer") or mlp.down_proj.tp.size != 1 or attn.head_dim % 16
            or mlp.act not in COMPILED_ACT or layer.input_layernorm.scale.dtype != torch.float32
            or layer.input_layernorm.scale.device.type != "cpu"):
        return None
    linears = [_linear(m) for m in mods]
    loras = [m.lora for m in mods]
    if any(x is None for x in linears) or not all(_lora_fits(lo, m) for lo, m in zip(loras, mods)):
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.gemma_norms:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    core = attn.attn
    consts = LayerConsts(
        norms=[n.scale for n in norms], eps=norms[0].eps,
        weights=[w for ws, _, _ in linears for w in ws], kinds=[k for _, ks, _ in linears for k in ks],
        block_types=[t for _, _, ts in linears for t in ts], part_counts=[len(ws) for ws, _, _ in linears],
        in_features=[m.in_features for m in mods], qkv_bias=attn.qkv_proj.bias,
        n_q=attn.n_heads, n_kv=attn.n_kv, head_dim=attn.head_dim,
        q_norm=attn.q_norm.scale if attn.qk_norm else None, k_norm=attn.k_norm.scale if attn.qk_norm else None,
        qk_eps=attn.q_norm.eps if attn.qk_norm else 0.0,
        scaling=core.scaling, softcap=core.softcap or 0.0, window=core.window or 0, act=COMPILED_ACT[mlp.act],
        **_lora_consts(loras))
    batch = next((lo.batch for lo in loras if lo is not None), None)
    return Plan(consts, attn.rope_key, core.layer_id, batch)


def forward(p: Plan, h: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool,
            rope: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    meta = fb.attn
    assert meta is not None, "ForwardBatch.build_attention must run before the model"
    cos, sin = rope[p.rope_key]
    return kernels.decoder_layer(h, p.consts, cos, sin, pool.k_buffer[p.layer_id], pool.v_buffer[p.layer_id],
                                 fb.out_cache_loc, meta.kv_flat, meta.row_kv_starts, meta.row_kv_lens,
                                 None if p.lora is None else p.lora.slots)

"""The one-call decoder layer's constant arguments, by name (kernels.decoder_layer, csrc/layer.cpp).

csrc/ops.h lists the same names (LOCKSTEP_LAYER_CONSTS); the compiled version builds its own
LayerConsts from these fields as keyword arguments, once per layer, and refuses a missing or
unknown name (tests/kernels/test_fused_kernels.py holds the two lists equal)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

# How a part is multiplied, by the weight plan's kind names (layers/block_weight.Kind values):
# the kinds the one-call layer serves (csrc/ops.h PartKind).
PART_KINDS = ("exact", "int8", "float")


@dataclass(frozen=True, eq=False)
class LayerConsts:
    norms: list[torch.Tensor]  # input, post-attention (+ Gemma's pre/post feed-forward), effective scales
    eps: float  # the norms' epsilon
    weights: list[torch.Tensor]  # every part of qkv, o, gate_up, down, in that order: blocks or float rows
    kinds: list[str]  # each part's kind, one of PART_KINDS ("float" alone in a linear: its own weight + bias)
    block_types: list[int]  # each part's GGML type id (kernels.BlockType.code; float parts: F32's)
    part_counts: list[int]  # parts per linear, 4 linears
    in_features: list[int]  # per linear
    qkv_bias: torch.Tensor | None  # Qwen2's
    n_q: int  # this rank's query heads
    n_kv: int  # and KV heads
    head_dim: int
    q_norm: torch.Tensor | None  # per-head q/k norms (Qwen3, Gemma)
    k_norm: torch.Tensor | None
    qk_eps: float
    scaling: float  # attention's
    softcap: float  # 0: none
    window: int  # 0: none
    act: str  # kernels.COMPILED_ACTS
    # LoRA (kernels.lora_sgmv's operands), one per linear, or none where no linear has adapter slots;
    # a linear without them: an empty tensor (lora/layers.LoraLinear keeps them, and fills them in place)
    lora_a: list[torch.Tensor] = field(default_factory=list)
    lora_b: list[torch.Tensor] = field(default_factory=list)
    lora_scales: list[torch.Tensor] = field(default_factory=list)
    lora_ranks: list[torch.Tensor] = field(default_factory=list)
    lora_splits: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.part_counts) != 4 or sum(self.part_counts) != len(self.weights):
            raise ValueError(f"part_counts {self.part_counts}: four linears whose parts add up to "
                             f"the {len(self.weights)} weights")
        if not (len(self.weights) == len(self.kinds) == len(self.block_types)):
            raise ValueError("one kind and block type per weight part")
        lora = {len(self.lora_a), len(self.lora_b), len(self.lora_scales), len(self.lora_ranks), len(self.lora_splits)}
        if len(lora) != 1 or lora.pop() not in (0, 4):
            raise ValueError("LoRA operands: none, or one of each per linear")
        if unknown := set(self.kinds) - set(PART_KINDS):
            raise ValueError(f"part kinds {sorted(unknown)}: the one-call layer serves {PART_KINDS}")

    def named(self) -> dict[str, Any]:
        """The fields as keyword arguments (what the compiled LayerConsts is built from)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

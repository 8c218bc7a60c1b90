from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep import kernels

# HF's activation names -> the fused kernels'. Float32 CPU rows run compiled where built; other
# dtypes and devices run the kernels' torch reference, the same F.silu / F.gelu(tanh) * up.
COMPILED_ACT = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    if act in COMPILED_ACT:
        return kernels.act_and_mul(gate_up, COMPILED_ACT[act])
    if act == "gelu":
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate) * up
    raise ValueError(f"unsupported activation {act!r}")

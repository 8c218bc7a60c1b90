from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep import kernels

# HF's activation names -> the fused kernels' (float32 rows run compiled where built)
_FUSED = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    if act in _FUSED and gate_up.dtype == torch.float32:
        return kernels.act_and_mul(gate_up, _FUSED[act])
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return F.gelu(gate, approximate="tanh") * up
    if act == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"unsupported activation {act!r}")

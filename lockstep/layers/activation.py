from __future__ import annotations

import torch
import torch.nn.functional as F


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return F.gelu(gate, approximate="tanh") * up
    if act == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"unsupported activation {act!r}")

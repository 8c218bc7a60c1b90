"""The one dispatch table. For every op: its compiled version in the variant this process loaded (None
where it has none), its plain-torch reference (reference.py), and the operands the compiled one takes.
Which compiled versions exist is decided once, when the table is built from build.selected(): the
variant, and what that variant's op needs of the CPU (the AVX-512 int8 path: VNNI; bfloat16: AMX).
A call then only checks its operands (CPU tensors, float32, rows of whole 32-element groups...), in
the op's `takes`; anything else runs the reference, which gives the same numbers (see reference.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

import torch

from lockstep.kernels import reference as ref
from lockstep.kernels.blocks import BlockType
from lockstep.kernels.build import missing_flags, selected
from lockstep.kernels.layer_consts import LayerConsts

GROUP = 32  # the compiled block kernels work in groups of 32 input elements


@dataclass(frozen=True)
class Kernel:
    reference: Callable[..., Any]
    compiled: Callable[..., Any] | None  # None: this process has no compiled version of the op
    takes: Callable[..., bool]  # whether the compiled version takes these operands

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None and self.takes(*args):
            return self.compiled(*args)
        return self.reference(*args)


@dataclass(frozen=True)
class Table:
    variant: str  # "avx512" | "avx2" | "torch"
    linear: Kernel
    linear_parts: Kernel
    embedding: Kernel
    linear_int8: Kernel
    linear_int8_parts: Kernel
    linear_bf16: Kernel
    decode_attention: Kernel
    argmax: Kernel
    rms_norm: Kernel
    add_rms_norm: Kernel
    qk_norm_rope: Kernel
    act_and_mul: Kernel
    lora_sgmv: Kernel  # LoRA adapters' products beside a linear, every slot's rows in one call
    # A whole decoder layer in one call (csrc/layer.cpp): the ops above in the modules' order, its
    # constants by name (layer_consts.LayerConsts)
    decoder_layer: Kernel

    def compiled(self, op: str) -> bool:
        """True when `op` has a compiled version in this process."""
        return getattr(self, op).compiled is not None


_KV_TYPES = (torch.float32, torch.float16, torch.bfloat16)  # the K/V pool types the attention kernel reads
LORA_SLOT_TYPES = (torch.float32, torch.bfloat16, torch.int8)  # what lora_sgmv's compiled kernel reads slots in


def _cpu_f32(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)


def _blocks_fit(x: torch.Tensor, blocks: torch.Tensor, kind: BlockType, n_cols: int) -> bool:
    # CPU tensors, rows of whole 32-element groups, bytes contiguous within a row (rows may be strided)
    return (n_cols % GROUP == 0 and blocks.stride(1) == 1 and x.device.type == "cpu"
            and blocks.device.type == "cpu")


def _rows(*ts: torch.Tensor, dims: tuple[int, ...] = (2,)) -> bool:  # float32 CPU rows, each contiguous
    return _cpu_f32(*ts) and all(t.dim() in dims and t.stride(-1) == 1 for t in ts)


def _slots_fit(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> bool:
    """LoRA slots: float32, bfloat16 or int8, both alike, float32 scales, each slot contiguous (the
    slots at any stride apart: views into lora/layers.py's per-slot buffers)."""
    def each_slot_contiguous(t: torch.Tensor) -> bool:
        return t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2]

    return (a.device.type == b.device.type == scales.device.type == "cpu" and a.dtype == b.dtype in LORA_SLOT_TYPES
            and a.dim() == b.dim() == 3 and each_slot_contiguous(a) and each_slot_contiguous(b)
            and scales.dtype == torch.float32 and scales.dim() == 2 and scales.stride(1) == 1)


def _compiled_ops(mod: ModuleType, variant: str) -> dict[str, Callable[..., Any]]:
    """The variant's functions, adapted to the references' signatures."""
    def attention(q, k_buf, v_buf, slots, starts, lens, scaling, softcap, window):  # noqa: ANN001, ANN202
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()  # the kernel takes rows at any stride, but each row's heads packed
        return mod.decode_attention(q, k_buf, v_buf, slots, starts, lens, scaling, softcap or 0.0, window or 0)

    def add_rms_norm(h, x, wx, wy, eps):  # noqa: ANN001, ANN202
        h2, y = mod.add_rms_norm(h, x, wx, wy, eps)
        return h2, (y if wy is not None else None)

    # each layer's LayerConsts built once into the compiled one, by keyword (a name the C++ side
    # lacks, or one it wants and is not given, is a TypeError naming it)
    built: weakref.WeakKeyDictionary[LayerConsts, Any] = weakref.WeakKeyDictionary()

    def decoder_layer(h, c, cos, sin, k_buf, v_buf, loc, kv_slots, starts, lens, lora_slots=None):  # noqa: ANN001, ANN202
        native = built.get(c)
        if native is None:
            native = built[c] = mod.LayerConsts(**c.named())
        return mod.decoder_layer(h=h, consts=native, cos=cos, sin=sin, k_buf=k_buf, v_buf=v_buf, loc=loc,
                                 kv_slots=kv_slots, starts=starts, lens=lens, lora_slots=lora_slots)

    ops: dict[str, Callable[..., Any]] = {
        "linear": lambda x, b, kind, k: mod.linear(x.contiguous(), b, kind.code, k),
        "linear_parts": lambda x, parts, k: mod.linear_parts(
            x.contiguous(), [b for b, _ in parts], [kind.code for _, kind in parts], k),
        "embedding": lambda ids, b, kind, k: mod.embedding(ids.contiguous(), b, kind.code, k),
        "decode_attention": attention,
        "argmax": mod.argmax_rows,
        "rms_norm": mod.rms_norm,
        "add_rms_norm": add_rms_norm,
        "qk_norm_rope": mod.qk_norm_rope,
        "act_and_mul": mod.act_and_mul,
        "lora_sgmv": mod.lora_sgmv,
        "decoder_layer": decoder_layer,
    }
    if variant == "avx2" or not missing_flags("int8_vnni"):
        ops["linear_int8"] = lambda x, b, kind, k: mod.linear_int8(x.contiguous(), b, kind.code, k)
        ops["linear_int8_parts"] = lambda x, parts, k: mod.linear_int8_parts(
            x.contiguous(), [b for b, _ in parts], [kind.code for _, kind in parts], k)
    if variant == "avx512" and not missing_flags("amx_bf16"):
        ops["linear_bf16"] = lambda x, b, kind, k: mod.linear_amx_bf16(
            x.to(torch.bfloat16).contiguous(), b, kind.code, k)
    return ops


_TAKES: dict[str, Callable[..., bool]] = {
    "linear": _blocks_fit, "linear_int8": _blocks_fit, "linear_bf16": _blocks_fit,
    "embedding": _blocks_fit,
    "linear_parts": lambda x, parts, k: all(_blocks_fit(x, b, kind, k) for b, kind in parts),
    "linear_int8_parts": lambda x, parts, k: all(_blocks_fit(x, b, kind, k) for b, kind in parts),
    # head dim: whole vectors of 16
    "decode_attention": lambda q, k_buf, *_: (_cpu_f32(q) and k_buf.device.type == "cpu" and k_buf.dtype in _KV_TYPES
                                              and q.shape[-1] % 16 == 0),
    "argmax": lambda x: _rows(x) and x.shape[1] > 0, "rms_norm": lambda x, w, eps: _rows(x) and _cpu_f32(w),
    "add_rms_norm": lambda h, x, wx, wy, eps: _rows(h, x),
    "qk_norm_rope": lambda qkv, n_q, n_kv, d, qw, kw, cos, sin, eps: _rows(qkv, cos, sin, dims=(1, 2, 3)),
    "act_and_mul": lambda g, act: _rows(g),
    "lora_sgmv": lambda y, x, a, b, scales, ranks, slots, splits: (
        _rows(y, x) and x.shape[1] % GROUP == 0 and _slots_fit(a, b, scales) and ranks.device.type == "cpu"
        and slots.device.type == "cpu"),
    "decoder_layer": lambda h, *_: _rows(h),
}


def build_table(variant: str, mod: ModuleType | None) -> Table:
    """The table of `variant` (its loaded module, None for the torch reference alone)."""
    compiled = _compiled_ops(mod, variant) if mod is not None else {}
    ops = {f.name: Kernel(getattr(ref, f.name), compiled.get(f.name), _TAKES[f.name])
           for f in fields(Table) if f.name in _TAKES}
    return Table(variant=variant, **ops)


@functools.cache
def table() -> Table:
    """This process's table, built once from the variant build.selected() loaded."""
    return build_table(*selected())

"""The weight plan: which kernel multiplies each part of each linear, decided once at load.

`choose` is the one decision, from the part's block type (read from the kernels' block-type table:
every BlockType has an exact kernel, INT8_QTYPES an int8 one), the device, the dtype, the flags and
the kernels this process compiled. The layers ask a `WeightPlan` to settle their loaded weights
(`WeightPlan.parts`, `float_weight`); it records every choice, so the start-up log and
/get_server_info print one summary of what was decided. After load nothing decides again: matmuls
switch on the parts' `Kind` (block_weight.py), and the one-call decoder layer reads the same kinds.

A new block type is an entry in kernels/blocks.py's table (and its decoders); a new kind is a `Kind`
member, a case in `choose` and one where matmuls switch on it. LoRA adapters run beside the parts
of any kind, after the base matmul (lockstep.lora.layers), so they are no kind of their own."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lockstep import kernels
from lockstep.kernels import INT8_QTYPES, BlockType
from lockstep.layers.block_weight import BlockWeight, Kind, Part, float32_rows, part_kind

_FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}  # GGML's names
_KERNEL_OPS = ("linear", "linear_int8", "linear_bf16")  # what a block kind runs on


def readable(ggml_type: str) -> BlockType | None:
    """The BlockType of a checkpoint's GGML type where the kernels read it; None where the loader
    must dequantize it once (the plan records that as a fallback, see `fallback_reason`)."""
    try:
        return kernels.block_type(ggml_type)
    except ValueError:
        return None


def fallback_reason(ggml_type: str) -> str:
    return f"no kernel for {ggml_type} here: dequantized to float32 at load"


@dataclass(frozen=True)
class Target:
    """Where the weights run: what `choose` decides from besides the weight's own type."""

    device: torch.device
    dtype: torch.dtype
    int8_activations: bool = False
    variant: str = "torch"
    compiled: frozenset[str] = frozenset()  # of _KERNEL_OPS, the ones this process runs compiled

    @classmethod
    def here(cls, device: str | torch.device, dtype: torch.dtype, int8_activations: bool = False) -> Target:
        """This process's target: its compiled kernels as the dispatch table has them."""
        return cls(torch.device(device), dtype, int8_activations, kernels.kernel_variant(),
                   frozenset(op for op in _KERNEL_OPS if kernels.compiled(op)))


def int8_default(blocks: bool, dtype: torch.dtype, device: str) -> bool:
    """--int8-activations' default: on for integer weight blocks (`blocks`: a GGUF, or
    --quantization into a type of INT8_QTYPES) on a CPU in float32 where the int8 kernel is
    compiled. Without it the exact path's fallback (blocks dequantized to float32) is the faster."""
    return device == "cpu" and dtype == torch.float32 and blocks and kernels.compiled("linear_int8")


def choose(qtype: BlockType, n_cols: int, t: Target) -> tuple[Kind, str]:
    """The kind a part of `qtype` blocks with `n_cols` input columns runs on, and, for FLOAT (its
    values dequantized once at load), why no block kernel serves it."""
    if t.device.type != "cpu":
        return Kind.FLOAT, f"the block kernels run on a CPU, not {t.device.type}"
    if n_cols % kernels.GROUP:
        return Kind.FLOAT, f"{n_cols} input columns are not whole groups of {kernels.GROUP}"
    if t.dtype == torch.float32:
        if t.int8_activations and qtype in INT8_QTYPES:
            return Kind.INT8, ""  # uncompiled, its torch reference gives the same numbers
        if "linear" in t.compiled:
            return Kind.EXACT, ""
        return Kind.FLOAT, f"no compiled kernel here (variant {t.variant})"
    if t.dtype == torch.bfloat16 and "linear_bf16" in t.compiled:
        return Kind.AMX_BF16, ""
    return Kind.FLOAT, (f"{t.dtype} activations: the block kernels take float32 (bfloat16 on a "
                        "CPU with AMX)")


@dataclass
class WeightPlan:
    """What the layers of one model run on, filled as they settle their weights at load."""

    target: Target
    counts: Counter[tuple[Kind, str]] = field(default_factory=Counter)  # (kind, stored type) -> parts
    fallbacks: dict[str, str] = field(default_factory=dict)  # stored type -> why not on its blocks

    def _record(self, kind: Kind, stored: str, why: str = "") -> None:
        self.counts[(kind, stored)] += 1
        if why:
            self.fallbacks.setdefault(stored, why)

    def parts(self, loaded: list[BlockWeight]) -> list[Part]:
        """What a layer multiplies by, from its loaded block parts (in output-row order): each on
        its kind's kernel (int8 ones in the layout that kernel reads fastest,
        kernels.unpack_for_int8: the same values), FLOAT ones dequantized once now; neighbours
        of one kind merged, so a layer whose parts agree runs one matmul."""
        out: list[Part] = []
        for w in loaded:
            kind, why = choose(w.qtype, w.n_cols, self.target)
            if w.stored and readable(w.stored) is None:  # the loader dequantized it already
                why = fallback_reason(w.stored)
            elif kind is not Kind.FLOAT:
                why = ""
            self._record(kind, w.stored_type, why)
            part: Part
            if kind is Kind.FLOAT:
                part = w.dequantize().to(device=self.target.device, dtype=self.target.dtype)
            elif kind is Kind.INT8:
                qtype, blocks = kernels.unpack_for_int8(w.qtype, w.blocks, w.n_cols)
                part = replace(w, blocks=blocks, qtype=qtype, kind=kind, stored=w.stored_type)
            else:
                part = replace(w, kind=kind)
            if out and _mergeable(out[-1], part):
                out[-1] = _merged(out[-1], part)
            else:
                out.append(part)
        return out

    def float_weight(self, weight: torch.Tensor, name: str = "") -> list[Part]:
        """A float checkpoint's weight: float32 rows on a CPU become F32 blocks over the same
        memory for the exact kernel (each output in a fixed order, so batch invariant as blocks
        are); elsewhere the float tensor itself, on torch's matmul."""
        kind, _ = choose(BlockType.F32, weight.shape[-1], self.target)
        if weight.dtype == torch.float32 and kind is Kind.EXACT:
            self._record(kind, "F32")
            return [float32_rows(weight, name)]
        self._record(Kind.FLOAT, _FLOAT_TYPES.get(weight.dtype, str(weight.dtype)))
        return [weight]

    def table_reads_blocks(self, table: BlockWeight) -> bool:
        """Whether embedding lookups read a block table as it is (float32 on a CPU, and bfloat16
        where AMX multiplies by the blocks); else the table becomes one float tensor, as a float
        checkpoint has."""
        kind, why = choose(table.qtype, table.n_cols, self.target)
        reads = self.target.device.type == "cpu" and (self.target.dtype == torch.float32
                                                       or kind is Kind.AMX_BF16)
        if not reads:  # the logits' parts are counted where the layer plans them (float_weight)
            self.fallbacks.setdefault(table.stored_type, why)
        return reads

    def summary(self) -> dict[str, Any]:
        """The plan as /get_server_info shows it: parts per kind and stored type, the types that
        fell back to dequantized floats and why, and what decided (variant, dtype, int8)."""
        kinds: dict[str, dict[str, int]] = {}
        for (kind, stored), n in sorted(self.counts.items()):
            kinds.setdefault(kind.value, {})[stored] = n
        t = self.target
        return {"kernel_variant": t.variant, "device": t.device.type, "dtype": str(t.dtype).removeprefix("torch."),
                "int8_activations": t.int8_activations, "parts": kinds, "fallbacks": dict(sorted(self.fallbacks.items()))}

    def describe(self) -> str:
        """One log line of the summary."""
        s = self.summary()
        kinds = "; ".join(f"{k}: " + ", ".join(f"{t} x{n}" for t, n in types.items())
                          for k, types in s["parts"].items())
        falls = "; ".join(f"{t} ({why})" for t, why in s["fallbacks"].items())
        return (f"weight plan ({s['kernel_variant']} kernels, {s['dtype']} on {s['device']}"
                f"{', int8 activations' if s['int8_activations'] else ''}): {kinds or 'no weights'}"
                + (f"; fell back to floats: {falls}" if falls else ""))


def _mergeable(a: Part, b: Part) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return True
    return (isinstance(a, BlockWeight) and isinstance(b, BlockWeight)
            and (a.qtype, a.n_cols, a.kind) == (b.qtype, b.n_cols, b.kind))


def _merged(a: Part, b: Part) -> Part:
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b])
    return replace(a, blocks=torch.cat([a.blocks, b.blocks]), stored=a.stored)


__all__ = ["Kind", "Target", "WeightPlan", "choose", "fallback_reason", "int8_default", "part_kind", "readable"]

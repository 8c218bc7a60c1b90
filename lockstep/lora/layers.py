"""The low-rank products beside each linear's base matmul (S-LoRA / Punica's shape): the base
multiplies the whole batch once, in its blocks or floats, as the weight plan chose; then one call
(kernels.lora_sgmv) adds x A^T B^T (B scaled by PEFT's alpha / r) to every adapter row's outputs,
each row by its own slot's weights. Rows of the base model get nothing added, so their numbers are
the base's.

Each linear keeps its slots' weights stacked, so that one call indexes them: A [slots, modules x
max rank, in] (a fused linear's modules, q/k/v or gate/up, share their input, so their A rows sit
together and one shrink serves them), B transposed [slots, max rank, local outputs] (each module's
B in its own output columns), and each slot's rank per module (0: the adapter leaves the module
out, which then costs nothing), and a float32 scale per A row (what its shrink result is multiplied
by: 1, or int8 slots' row scales). Like SGLang's LoRA memory pool, the slots are allocated at start
(--max-loras-per-batch x --max-lora-rank), in the type `slot_dtype` picks, as one buffer per slot:
each linear's A and B are views into it, laid out in the order a forward reads them (layer by layer:
qkv's A then B, o's, gate/up's, down's), so one adapter's weights stream from memory as one run
(with the slots side by side per linear instead, a decode step's reads restarted at every linear,
apart by the other slots' weights: one user's step with an adapter was measurably slower on a
server of 8 slots than of 1).

Batch invariance: each row's product is computed on its own in a fixed order (csrc/lora.cpp on a
CPU, in float32 arithmetic whatever the slots' type; elsewhere the reference's batched 1-row
products), so a request's output is the same alone and in a batch that mixes adapters
(tests/model/test_lora.py checks bitwise).

Tensor parallelism: A is whole (each rank's linear sees every input column: column-parallel
layers take x whole, row-parallel ones gather it first) and B keeps the output rows of this
rank's shard, the rows its base weight keeps, so the delta lands on the rank's own outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lockstep import kernels
from lockstep.forward_batch import ForwardBatch
from lockstep.layers.weight_plan import Target
from lockstep.lora.adapter import LoraAdapter

# our fused linear (its path in a decoder layer) -> the PEFT modules its outputs hold, in order
LINEARS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
           "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


def slot_dtype(target: Target, requested: str = "auto") -> torch.dtype:
    """The type the adapter slots hold A and B in (--lora-dtype; auto from the base's precision, the
    weight plan's target): int8 under int8 activations on a CPU, where a decode step streams every
    adapter row's A and B from memory beside the base's blocks, so the bytes are what one user's
    step feels (docs/benchmarks.md, "Adapters in int8"), and activations rounded to 8 bits per
    block already set the path's agreement with float32: each row of A, and each of B transposed,
    to 8 bits with a float32 scale of its own (the kernel widens each value exactly and multiplies
    in float32); else the model's dtype, so the exact float32 path stays float32 end to end (the
    HF + PEFT oracle: even bfloat16's 8-bit mantissa moves these random adapters' logprobs far
    past its tests' tolerance)."""
    if requested != "auto":
        return getattr(torch, requested)
    if target.device.type == "cpu" and target.dtype == torch.float32 and target.int8_activations:
        return torch.int8
    return target.dtype


def _int8_scales(w: torch.Tensor) -> torch.Tensor:
    """Each row's symmetric int8 scale: its largest magnitude maps to 127 (float32 [rows])."""
    return w.float().abs().amax(dim=1) / 127.0


def _to_int8(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w's rows divided by their scales, rounded to int8 (a zero row stays zero)."""
    return torch.round(w.float() / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).to(torch.int8)


@dataclass
class LoraBatch:
    """This forward's adapter rows, shared by every LoraLinear of the model: each row's slot
    (int64 [T], -1 for the base), or None when no row has an adapter."""

    slots: torch.Tensor | None = None


class LoraLinear:
    """One linear's adapters in the resident slots, and the product it adds to the base output."""

    def __init__(self, subs: tuple[str, ...], rows: list[tuple[int, int]], batch: LoraBatch,
                 a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        self.subs = subs
        self.rows = rows  # per module: the rows of its whole B this rank keeps
        self.splits = out_splits(rows)  # each module's output columns
        self.batch = batch
        self.max_rank = b.shape[1]
        self.a = a  # [slots, modules x max rank, in] (views into the slots' buffers)
        self.b = b  # [slots, max rank, local outputs]
        self.scales = scales  # float32 [slots, modules x max rank]: each A row's shrink result times this
        self.ranks = torch.zeros(a.shape[0], len(subs), dtype=torch.int64)  # read on the host

    def set_slot(self, slot: int, ab: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` holds these modules' (A, B) (None: not adapted). int8 slots: A's rows and B's
        columns (the rows of B transposed) each to 8 bits with a scale of its own, the two scales
        multiplied into the row's; B's scales from its whole columns, so that a tensor-parallel rank's
        shard holds exactly the whole module's int8 values for its rows."""
        self.ranks[slot] = 0
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scales[slot] = 1.0
        r_max = self.max_rank
        for m, pair in enumerate(ab):
            if pair is None:
                continue
            a, b = pair
            r, (start, end) = a.shape[0], self.rows[m]
            rows, cols = slice(m * r_max, m * r_max + r), slice(self.splits[m], self.splits[m + 1])
            bt = b[start:end].T
            if self.a.dtype == torch.int8:
                sa, sb = _int8_scales(a), _int8_scales(b.T)
                a, bt = _to_int8(a, sa), _to_int8(bt, sb)
                self.scales[slot, rows] = sa * sb
            self.a[slot, rows] = a
            self.b[slot, :r, cols] = bt
            self.ranks[slot, m] = r

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base's output for rows x) with each adapter row's low-rank product added."""
        if self.batch.slots is not None:
            kernels.lora_sgmv(y, x, self.a, self.b, self.scales, self.ranks, self.batch.slots, self.splits)
        return y


def out_splits(rows: list[tuple[int, int]]) -> list[int]:
    """Each module's first output column, and the end: the modules' kept rows side by side."""
    widths = [e - s for s, e in rows]
    return [sum(widths[:i]) for i in range(len(widths) + 1)]


def _rows(linear: nn.Module, subs: tuple[str, ...]) -> list[tuple[int, int]]:
    """The rows of each module's whole B that this rank's shard of `linear` holds (as its
    weight_loader keeps the base's rows)."""
    tp = linear.tp
    if subs[0] == "q_proj":
        d, q, kv = linear.head_dim, linear.n_heads_local * linear.head_dim, linear.n_kv_local * linear.head_dim
        k0 = linear.kv_head_start() * d
        return [(tp.rank * q, (tp.rank + 1) * q), (k0, k0 + kv), (k0, k0 + kv)]
    if subs[0] == "gate_proj":
        return [tp.shard_range(n) for n in linear.out_sizes]
    return [tp.shard_range(linear.out_local * tp.size)]


class LoraLayers:
    """Every adapted linear of a model (this rank's layers), the batch they read, and the slots."""

    def __init__(self, model: nn.Module, targets: frozenset[str], n_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.batch = LoraBatch()
        self.n_slots = n_slots
        self.linears: list[tuple[int, LoraLinear]] = []  # (layer index, its adapted linear)
        plan = []  # (layer index, linear, modules, kept rows, A's shape, B's shape) in a forward's order
        for i, layer in enumerate(model.stage_layers):
            for path, subs in LINEARS.items():
                if targets & set(subs):
                    linear = layer.get_submodule(path)
                    rows = _rows(linear, subs)
                    plan.append((model.start_layer + i, linear, subs, rows, (len(subs) * max_rank, linear.in_features),
                                 (max_rank, out_splits(rows)[-1])))
        align = 64 // dtype.itemsize  # elements: each view starts 64-byte aligned
        size = lambda shape: -(-shape[0] * shape[1] // align) * align  # noqa: E731
        per_slot = sum(size(a) + size(b) for *_, a, b in plan)
        self.buffer = torch.zeros(n_slots, per_slot, dtype=dtype, device=device)
        # each A row's scale (1: float slots), the linears' side by side in a slot's own buffer too
        self.scales = torch.ones(n_slots, sum(a[0] for *_, a, _ in plan), device=device)
        at = at_scale = 0
        for layer_index, linear, subs, rows, a_shape, b_shape in plan:
            views = []
            for shape in (a_shape, b_shape):
                views.append(self.buffer[:, at:at + shape[0] * shape[1]].view(n_slots, *shape))
                at += size(shape)
            views.append(self.scales[:, at_scale:at_scale + a_shape[0]])
            at_scale += a_shape[0]
            linear.lora = LoraLinear(subs, rows, self.batch, *views)
            self.linears.append((layer_index, linear.lora))
        model.after_loading()  # the one-call layers take the adapter slots' weights

    def set_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Make `adapter` resident in `slot` on every adapted linear (None: empty the slot)."""
        for layer, lin in self.linears:
            ab = [adapter.weights.get((layer, s)) if adapter else None for s in lin.subs]
            lin.set_slot(slot, ab)

    def prepare(self, fb: ForwardBatch) -> None:
        """This forward's slot of each row, from each request's slot (-1: the base model)."""
        slots = fb.lora_slots or []
        if all(s < 0 for s in slots):
            self.batch.slots = None
            return
        per_row = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), fb.extend_lens.cpu())
        self.batch.slots = per_row.to(fb.input_ids.device)

"""The low-rank products beside each linear's base matmul (S-LoRA / Punica's shape): the base
multiplies the whole batch once, in its blocks or floats, as the weight plan chose; then for each
run of rows that belongs to one adapter, x A^T B^T (B scaled by PEFT's alpha / r) is added to those
rows' outputs. Rows of the base model get nothing added, so their numbers are the base's.

Batch invariance: torch's matmul picks its blocking by the number of rows, so a row's sum would
depend on its neighbours. `rowwise` multiplies each row alone (a batched product of 1-row
matrices, the same small kernel for every row), so a request's output is the same alone and in a
batch that mixes adapters (tests/model/test_lora.py checks bitwise). On a CPU in float32 the
compiled exact kernel does it (each output summed in a fixed order, kernels.linear), else a
batched product of 1-row matrices.

Tensor parallelism: A is whole (each rank's linear sees every input column: column-parallel
layers take x whole, row-parallel ones gather it first) and B keeps the output rows of this
rank's shard, the rows its base weight keeps, so the delta lands on the rank's own outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lockstep import kernels
from lockstep.forward_batch import ForwardBatch
from lockstep.layers.block_weight import BlockWeight, block_matmul, float32_rows
from lockstep.lora.adapter import LoraAdapter

# our fused linear (its path in a decoder layer) -> the PEFT modules its outputs hold, in order
LINEARS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
           "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


def rowwise(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ wt [K, N], each row multiplied alone: its bits never depend on T."""
    return torch.bmm(x.unsqueeze(1), wt.expand(x.shape[0], *wt.shape)).squeeze(1)


Rows = slice | torch.Tensor  # a run of consecutive rows, or the rows' indices


@dataclass
class LoraBatch:
    """This forward's adapter rows, shared by every LoraLinear of the model: per adapter slot
    in the batch, its rows (wherever the scheduler placed its requests)."""

    groups: list[tuple[int, Rows]] = field(default_factory=list)


# A row-wise product's weight: float32 rows [N, K] for the exact kernel (kernels.linear: each
# output summed in a fixed order, whatever the other rows), or W^T [K, N] for `rowwise`.
Weight = BlockWeight | torch.Tensor


def row_product(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, K] times the weight, each row's bits independent of T."""
    return block_matmul(x.contiguous(), w) if isinstance(w, BlockWeight) else rowwise(x, w)


def _weight(w: torch.Tensor, like: torch.Tensor) -> Weight:
    """[N, K] as the row-wise product reads it: float32 rows on a CPU whose exact kernel is
    compiled (faster than torch's batched 1-row products), W^T elsewhere."""
    n, k = w.shape
    if (like.device.type == "cpu" and like.dtype == torch.float32 and kernels.compiled("linear")
            and k % kernels.GROUP == 0):
        return float32_rows(w.contiguous())
    return w.T.contiguous().to(device=like.device, dtype=like.dtype)


@dataclass(frozen=True)
class _SlotWeights:
    a: Weight  # every present module's A stacked: [sum of r (padded), K]
    b: Weight  # each module's B in its columns and output rows (block diagonal): [local outputs, sum of r]


class LoraLinear:
    """One linear's adapters in the resident slots, and the product it adds to the base output."""

    def __init__(self, subs: tuple[str, ...], rows: list[tuple[int, int]], batch: LoraBatch,
                 n_slots: int) -> None:
        self.subs = subs
        self.rows = rows  # per module: the rows of its whole B this rank keeps
        self.widths = [e - s for s, e in rows]
        self.offsets = [sum(self.widths[:i]) for i in range(len(rows))]
        self.batch = batch
        self.slots: list[_SlotWeights | None] = [None] * n_slots

    def set_slot(self, slot: int, ab: list[tuple[torch.Tensor, torch.Tensor] | None],
                 like: torch.Tensor) -> None:
        """Slot `slot` holds these modules' (A, B) (None: not adapted), on `like`'s device/dtype."""
        present = [(i, a, b) for i, pair in enumerate(ab) if pair is not None for a, b in [pair]]
        if not present:
            self.slots[slot] = None
            return
        # B block-diagonal: one product expands every module's rows into its own outputs (the
        # zeros add nothing), modules the adapter leaves out get zeros; the rank is padded with
        # zeros to whole groups of the exact kernel's 32 columns
        r = sum(a.shape[0] for _, a, _ in present)
        r_pad = -(-r // kernels.GROUP) * kernels.GROUP
        a = torch.zeros(r_pad, present[0][1].shape[1])
        b = torch.zeros(self.offsets[-1] + self.widths[-1], r_pad)
        col = 0
        for i, a_i, b_i in present:
            start, end = self.rows[i]
            a[col:col + a_i.shape[0]] = a_i
            b[self.offsets[i]:self.offsets[i] + end - start, col:col + a_i.shape[0]] = b_i[start:end]
            col += a_i.shape[0]
        self.slots[slot] = _SlotWeights(_weight(a, like), _weight(b, like))

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base's output for rows x) with each adapter row's low-rank product added."""
        for slot, rows in self.batch.groups:
            w = self.slots[slot]
            if w is None:
                continue
            delta = row_product(row_product(x[rows], w.a), w.b)
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y


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

    def __init__(self, model: nn.Module, targets: frozenset[str], n_slots: int) -> None:
        self.batch = LoraBatch()
        self.n_slots = n_slots
        self.linears: list[tuple[int, LoraLinear]] = []  # (layer index, its adapted linear)
        for i, layer in enumerate(model.stage_layers):
            for path, subs in LINEARS.items():
                if not targets & set(subs):
                    continue
                linear = layer.get_submodule(path)
                linear.lora = LoraLinear(subs, _rows(linear, subs), self.batch, n_slots)
                self.linears.append((model.start_layer + i, linear.lora))
        model.after_loading()  # adapted layers run their modules, not the one-call layer
        self._like = next(model.parameters())

    def set_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Make `adapter` resident in `slot` on every adapted linear (None: empty the slot)."""
        for layer, lin in self.linears:
            ab = [adapter.weights.get((layer, s)) if adapter else None for s in lin.subs]
            lin.set_slot(slot, ab, self._like)

    def prepare(self, fb: ForwardBatch) -> None:
        """This forward's rows of each adapter, from each request's slot (-1: the base model):
        a slice where they are consecutive, else their indices."""
        rows: dict[int, list[int]] = {}
        at = 0
        for slot, n in zip(fb.lora_slots or [], fb.extend_lens.tolist()):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(at, at + n))
            at += n
        device = fb.input_ids.device
        self.batch.groups = [
            (slot, slice(r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r)
             else torch.tensor(r, dtype=torch.int64, device=device))
            for slot, r in sorted(rows.items()) if r]

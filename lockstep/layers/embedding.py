"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

A GGUF's table stays in its blocks: a lookup gathers the blocks of the wanted rows and
dequantizes only those, so no float copy of the table exists; a tied LM head multiplies by the
same blocks (or, where no kernel serves their type, by floats dequantized once at load)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep import kernels
from lockstep.distributed.parallel_state import ParallelGroup
from lockstep.layers.block_weight import BlockWeight, Part, matmul_parts, pack
from lockstep.layers.linear import _copy, _param
from lockstep.layers.weight_plan import WeightPlan


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: ParallelGroup, dtype: torch.dtype,
                 serves_logits: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden = hidden
        self.serves_logits = serves_logits  # the LM head too (tied, or ParallelLMHead)
        # Pad so the vocabulary splits evenly; padded rows are zero and never sampled.
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        self.start, self.end = tp.shard_range(self.padded_vocab)
        self.weight: nn.Parameter | None = _param((self.end - self.start, hidden), dtype,
                                                  self.weight_loader)
        self._dtype, self._device = dtype, self.weight.device
        self.table: BlockWeight | None = None  # lookups read these blocks when set
        self.logits_parts: list[Part] | None = None  # what logits multiply by (set at finish_loading)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | BlockWeight) -> None:
        if isinstance(loaded, BlockWeight):
            local = loaded.rows(self.start, min(self.end, self.vocab_size))
            self.table = local.padded_rows(self.end - self.start)
            return
        shard = loaded[self.start:min(self.end, self.vocab_size)]
        param.data.zero_()
        _copy(param.data[: shard.shape[0]], shard, "vocab-parallel embedding")

    def pack(self, qtype: str, name: str) -> None:
        """--quantization: the float table becomes `qtype` blocks (before finish_loading)."""
        if self.weight is not None and self.table is None:
            self.table = pack(self.weight, qtype, name)

    def finish_loading(self, plan: WeightPlan) -> None:
        """Settle the table as `plan` decides: lookups read a block table as it is where they can
        (else one float table, as a float checkpoint has); the logits multiply by the parts the
        plan gives (block kinds, F32 rows of a float32 table, or the float table itself)."""
        if self.table is not None and not plan.table_reads_blocks(self.table):
            self.weight = nn.Parameter(self.table.dequantize().to(self._device, self._dtype),
                                       requires_grad=False)
            self.table = None
        if self.table is not None:
            self.weight = None
        if not self.serves_logits:
            return
        self.logits_parts = (plan.parts([self.table]) if self.table is not None
                             else plan.float_weight(self.weight.data))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        mine = (ids >= self.start) & (ids < self.end)
        out = self._rows(torch.where(mine, ids - self.start, 0))
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)

    def _rows(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return F.embedding(local_ids, self.weight)
        t = self.table
        out = kernels.embedding(local_ids.reshape(-1), t.blocks, t.qtype, t.n_cols)
        return out.to(self._dtype).view(*local_ids.shape, self.hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for this rank's vocab slice, gathered so every rank sees the full row."""
        local = matmul_parts(hidden, self.logits_parts)
        return self.tp.all_gather(local, dim=-1)[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same vocab-sliced weight, used only for logits."""

    def __init__(self, vocab_size: int, hidden: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(vocab_size, hidden, tp, dtype, serves_logits=True)

"""The last step of an embedding or scoring model's forward, in place of logits and sampling:
every row of each request's prompt (a pooled request is never chunked and has no cached prefix,
so its rows are its whole prompt) pooled into one vector per request, by mean, first ([CLS]) or
last token, then L2-normalized or put through the model's classifier (lockstep.model_loader.pooling).

Each request's rows are pooled on their own (a slice of the batch's hidden states), and every
layer below is row-wise, so a vector is bitwise the same whatever it was batched with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.forward_batch import ForwardBatch
from lockstep.model_loader.pooling import Pooling


def all_rows(fb: ForwardBatch) -> None:
    """Ask the model for the hidden state of every row (not only the sampled ones)."""
    fb.logits_indices = torch.arange(fb.input_ids.numel(), device=fb.input_ids.device)


def pool(hidden: torch.Tensor, extend_lens: torch.Tensor, pooling: Pooling,
         model: nn.Module) -> list[list[float]]:
    """hidden: [T, H], every row of the batch in request order -> one vector (or one score list)
    per request."""
    rows = []
    start = 0
    for n in extend_lens.tolist():
        part = hidden[start:start + n]
        start += n
        if pooling.mode == "mean":
            rows.append(part.float().mean(0))
        else:
            rows.append(part[0 if pooling.mode == "cls" else n - 1].float())
    pooled = torch.stack(rows) if rows else hidden.new_zeros((0, hidden.shape[-1]))
    if pooling.classify:
        pooled = model.classify(pooled.to(hidden.dtype)).float()
    elif pooling.normalize:
        pooled = torch.cat([F.normalize(r[None], dim=-1) for r in pooled]) if rows else pooled
    return pooled.tolist()

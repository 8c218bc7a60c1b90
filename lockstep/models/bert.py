"""BERT encoders (BertModel; BertForSequenceClassification, the cross-encoder rerankers) on
lockstep's own layers: the tensor-parallel linears (float32 weights as F32 blocks on a CPU, each
output row summed in a fixed order) and the attention kernel (each row alone, its sum in an order
fixed by its own keys), run bidirectionally: every row of a request sees all of its keys.

An encoder's K/V are read by this pass alone (a pooled request ends with it, and K/V at a
position depend on the tokens after it, so no prefix is ever shared): the kernel reads them where
the projection wrote them, not from the KV pool, whose slots the scheduler still accounts for.

Post-LN: x = LN(x + attn(x)); x = LN(x + FFN(x)). Segment (token type) ids are not on the wire:
they are what BERT's tokenizer gives a pair, 0 up to and including the first separator and 1
after it, derived here from the ids (ModelConfig.sep_token_id; all 0 without one).

The forward returns the final hidden state of every row at fb.logits_indices (the pooling step,
lockstep.managers.pooling_step, picks and pools them); a classifier's `classify` turns pooled
[CLS] rows into scores (BERT's pooler: dense + tanh, then the classifier)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.configs.model_config import ModelConfig
from lockstep.distributed.parallel_state import NO_PIPELINE, ParallelGroup, PipelineGroup
from lockstep.forward_batch import ForwardBatch
from lockstep.kernels import decode_attention
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.embedding import VocabParallelEmbedding
from lockstep.layers.layer_norm import LayerNorm
from lockstep.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    _copy,
    _param,
)
from lockstep.layers.weight_loading import all_loaded, load_param
from lockstep.mem_cache.memory_pool import TokenToKVPool

# checkpoint name -> (our name, q/k/v shard) for the fused projection; the rest map one to one
_RENAMES = {".attention.self.query.": (".attention.qkv_proj.", "q"),
            ".attention.self.key.": (".attention.qkv_proj.", "k"),
            ".attention.self.value.": (".attention.qkv_proj.", "v"),
            ".attention.output.dense.": (".attention.o_proj.", None),
            ".attention.output.LayerNorm.": (".attention_norm.", None),
            ".output.LayerNorm.": (".output_norm.", None)}

# a cross-encoder's head, [CLS] -> dense -> tanh -> scores: BERT's pooler + classifier and
# RoBERTa's classifier.dense + classifier.out_proj are the same math under other names
_HEADS = {f"{ckpt}.{w}": f"{ours}.{w}" for ckpt, ours in (
    ("pooler.dense", "pooler_dense"), ("classifier.dense", "pooler_dense"),
    ("classifier.out_proj", "classifier")) for w in ("weight", "bias")}


def _activation(name: str):  # noqa: ANN202 - a torch elementwise function
    return {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
            "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}[name]


class _Table(nn.Module):
    """A small replicated lookup table (positions, segments); a GGUF's (F32 blocks, as llama.cpp's
    converter writes it) is read into floats once."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param((rows, dim), dtype, lambda p, t: _copy(
            p, t.dequantize().to(dtype) if isinstance(t, BlockWeight) else t, "embedding table"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


@dataclass(frozen=True)
class RowKeys:
    """Which keys each row sees, in the layout of kernels.decode_attention: the batch's own K/V
    rows (slots 0..T-1), and per row its request's first row and length."""

    slots: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor

    @classmethod
    def of(cls, fb: ForwardBatch) -> RowKeys:
        ext = fb.extend_lens
        first = torch.cumsum(ext, 0) - ext
        return cls(torch.arange(fb.input_ids.numel(), device=ext.device),
                   first.repeat_interleave(ext), ext.repeat_interleave(ext))


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.position_embeddings = _Table(cfg.max_position, cfg.hidden_size, dtype)
        self.token_type_embeddings = _Table(max(1, cfg.type_vocab_size), cfg.hidden_size, dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)  # noqa: N815 - HF's name
        self.sep = cfg.sep_token_id
        self.offset = cfg.position_offset

    def segments(self, fb: ForwardBatch) -> torch.Tensor:
        """1 for a token after its request's first separator, else 0 (the pair encoding)."""
        ids = fb.input_ids
        if self.sep is None or self.token_type_embeddings.weight.shape[0] < 2:
            return torch.zeros_like(ids)
        is_sep = (ids == self.sep).to(torch.int64)
        seen = torch.cumsum(is_sep, 0) - is_sep  # separators before each token, batch-wide
        starts = torch.cumsum(fb.extend_lens, 0) - fb.extend_lens
        before_request = (seen[starts] if ids.numel() else seen).repeat_interleave(fb.extend_lens)
        return ((seen - before_request) > 0).to(torch.int64)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        x = (self.word_embeddings(fb.input_ids) + self.position_embeddings(fb.positions + self.offset)
             + self.token_type_embeddings(self.segments(fb)))
        return self.LayerNorm(x)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_heads, True, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, True, tp, dtype)
        self.n_heads, self.n_kv = self.qkv_proj.n_heads_local, self.qkv_proj.n_kv_local
        self.head_dim = d
        self.scaling = d**-0.5

    def forward(self, x: torch.Tensor, rows: RowKeys) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        t, d = x.shape[0], self.head_dim
        q = q.contiguous().view(t, self.n_heads, d)
        k, v = k.contiguous().view(t, self.n_kv, d), v.contiguous().view(t, self.n_kv, d)
        return self.o_proj(decode_attention(q, k, v, rows.slots, rows.starts, rows.lens,
                                            self.scaling, None, None))


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, layer_id, tp, dtype)
        self.self_attn = self.attention  # what the model runner reads the KV heads from
        self.attention_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.intermediate = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp, dtype)
        self.output = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, dtype)
        self.output_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.act = _activation(cfg.hidden_act)

    def forward(self, h: torch.Tensor, rows: RowKeys) -> torch.Tensor:
        # in place into the fresh sublayer outputs: no new [T, hidden] tensor per residual
        h = self.attention_norm(self.attention(h, rows).add_(h))
        return self.output_norm(self.output(self.act(self.intermediate(h))).add_(h))


class BertModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype,
                 pp: PipelineGroup = NO_PIPELINE) -> None:
        super().__init__()
        if pp.size > 1:
            raise ValueError("BERT encoders run on one pipeline stage (--pp-size 1)")
        self.cfg, self.pp = cfg, pp
        self.start_layer, self.end_layer = 0, cfg.num_layers
        self.embeddings = BertEmbeddings(cfg, tp, dtype)
        self.layers = nn.ModuleList(BertLayer(cfg, i, tp, dtype) for i in range(cfg.num_layers))
        if cfg.num_labels:
            # replicated (a few hundred numbers): the pooler and classifier of the [CLS] row
            self.pooler_dense = _Linear(cfg.hidden_size, cfg.hidden_size, dtype)
            self.classifier = _Linear(cfg.hidden_size, cfg.num_labels, dtype)

    def after_loading(self) -> None:
        pass

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool,
                hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embeddings(fb)
        rows = RowKeys.of(fb)
        for layer in self.layers:
            h = layer(h, rows)
        return h[fb.logits_indices]

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] [CLS] rows -> [B, num_labels] scores (logits, before any sigmoid)."""
        return self.classifier(torch.tanh(self.pooler_dense(pooled)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockWeight]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.").removeprefix("roberta.").replace("encoder.layer.", "layers.")
            name = _HEADS.get(name, name)
            shard = None
            for ckpt, (ours, shard_id) in _RENAMES.items():
                if ckpt in name:
                    name, shard = name.replace(ckpt, ours), shard_id
                    break
            name = name.replace(".intermediate.dense.", ".intermediate.").replace(".output.dense.", ".output.")
            if name not in params:
                if name.startswith(("pooler", "embeddings.position_ids", "cls.")):
                    continue  # an embedding model's unused pooler / MLM head
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            load_param(params[name], tensor, shard)
            loaded.add(name)
        return all_loaded(params, loaded)


class _Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype) -> None:
        super().__init__()
        load = lambda p, t: _copy(p, t, "classifier head")  # noqa: E731
        self.weight = _param((n_out, n_in), dtype, load)
        self.bias = _param((n_out,), dtype, load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

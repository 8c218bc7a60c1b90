"""Llama 3.x, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm): one decoder, config-driven."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lockstep import kernels
from lockstep.configs.model_config import ModelConfig
from lockstep.distributed.parallel_state import (
    NO_PIPELINE,
    ParallelGroup,
    PipelineGroup,
    partition_layers,
)
from lockstep.forward_batch import ForwardBatch
from lockstep.layers.activation import act_and_mul
from lockstep.layers.attention import PagedAttention
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from lockstep.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from lockstep.layers.norm import RMSNorm, add_norm
from lockstep.layers.rotary import RotaryEmbedding
from lockstep.layers.weight_loading import all_loaded, load_param
from lockstep.mem_cache.memory_pool import TokenToKVPool
from lockstep.models import one_call

# checkpoint name fragment -> (our parameter fragment, shard id for fused parameters)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]  # rope key -> (cos, sin) [T, head_dim]


def rope_key(cfg: ModelConfig, layer_id: int) -> str:
    """Which RoPE a layer rotates by: "local" (sliding-window layers of models with a local base)
    or "global"."""
    local = cfg.layer_windows[layer_id] is not None and cfg.rope_local is not None
    return "local" if local else "global"


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.head_dim
        window = cfg.layer_windows[layer_id]
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, tp, dtype)
        self.n_heads, self.n_kv = self.qkv_proj.n_heads_local, self.qkv_proj.n_kv_local
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, gemma=cfg.is_gemma)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, gemma=cfg.is_gemma)
        self.rope_key = rope_key(cfg, layer_id)
        scalar = cfg.query_pre_attn_scalar or d
        self.attn = PagedAttention(layer_id, self.n_heads, self.n_kv, d, scalar**-0.5, window,
                                   cfg.attn_logit_softcapping)
        self.qk_norm = cfg.qk_norm
        self.head_dim = d

    def forward(self, x: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool,
                rope: RopeTables) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        cos, sin = rope[self.rope_key]
        d = self.head_dim
        if qkv.dtype == torch.float32:  # q/k norms and rotary in one fused call, in place in qkv
            q_w, k_w, eps = ((self.q_norm.scale, self.k_norm.scale, self.q_norm.eps)
                             if self.qk_norm else (None, None, 0.0))
            q, k, v = kernels.qk_norm_rope(qkv, self.n_heads, self.n_kv, d, q_w, k_w, cos, sin, eps)
        else:
            q, k, v = self.qkv_proj.split(qkv)
            t = x.shape[0]
            q, k, v = q.view(t, self.n_heads, d), k.view(t, self.n_kv, d), v.view(t, self.n_kv, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = kernels.rotate(q, cos, sin), kernels.rotate(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, fb, pool))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, tp, dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp, dtype)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))


class LlamaDecoderLayer(nn.Module):
    gemma_norms = False  # True: the RMSNorms scale by (1 + w) (Gemma)

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp, dtype)
        self.mlp = MLP(cfg, tp, dtype)
        self.input_layernorm = self.norm(cfg, dtype)
        self.post_attention_layernorm = self.norm(cfg, dtype)

    @classmethod
    def norm(cls, cfg: ModelConfig, dtype: torch.dtype) -> RMSNorm:
        """An RMSNorm over the hidden size, of this layer's kind (the model's final norm too)."""
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, gemma=cls.gemma_norms)

    def forward(self, h: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool,
                rope: RopeTables) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), fb, pool, rope)
        h, x = add_norm(h, a, None, self.post_attention_layernorm)
        return h + self.mlp(x)


class LlamaForCausalLM(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # name prefixes of parameters a subclass loads itself (a vision tower), not load_weights
    other_params: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype,
                 pp: PipelineGroup = NO_PIPELINE) -> None:
        super().__init__()
        self.cfg = cfg
        self.pp = pp
        self.start_layer, self.end_layer = partition_layers(cfg.num_layers, pp.size, pp.rank)
        # per layer: kernels.decoder_layer's constant arguments, or None where its modules run (all
        # of them until after_loading plans them from the settled weights)
        self.one_call_args: list[one_call.Plan | None] = [None] * (self.end_layer - self.start_layer)
        # A pipeline stage builds only its own layers; the others are empty placeholders so
        # that parameter names keep their checkpoint layer index.
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, i, tp, dtype) if self.start_layer <= i < self.end_layer else nn.Identity()
            for i in range(cfg.num_layers))
        self.stage_layers = list(self.layers)[self.start_layer:self.end_layer]  # sliced once, not per step
        # one rotary per distinct RoPE config; its cos/sin are computed once per forward
        self.rotary = nn.ModuleDict({
            key: RotaryEmbedding(cfg.head_dim, cfg.rope_local if key == "local" else cfg.rope_global)
            for key in sorted({rope_key(cfg, i) for i in range(self.start_layer, self.end_layer)})})
        if pp.is_first or (pp.is_last and cfg.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, tp, dtype,
                serves_logits=pp.is_last and cfg.tie_word_embeddings)
        if pp.is_last:
            self.norm = self.layer_cls.norm(cfg, dtype)
            self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                            else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype))
        # a yes/no reranker's classifier, [labels, hidden]: its LM head's rows of the label
        # tokens (cfg.label_token_ids), read from the settled head by after_loading
        self.label_rows: torch.Tensor | None = None

    def after_loading(self) -> None:
        """Once the weights are settled (weight_setup): which layers run in one compiled call, with
        references to their settled tensors (so a later change of weights needs this again)."""
        self.one_call_args = [one_call.plan(layer) for layer in self.stage_layers]
        if self.cfg.label_token_ids and self.pp.is_last:
            # a lookup of the head's rows: the same numbers its logits multiply by (dequantized
            # where the head is in blocks), gathered from the rank that holds each under TP
            ids = torch.tensor(self.cfg.label_token_ids, device=self.norm.weight.device)
            self.label_rows = self.lm_head(ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def embed_inputs(self, fb: ForwardBatch) -> torch.Tensor:
        """The batch's input embeddings (a multimodal model puts its images' features in)."""
        return self.embed(fb.input_ids)

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool,
                hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """The last stage returns final-normed hidden states at fb.logits_indices only; earlier
        stages return every token's hidden state for the next stage."""
        h = self.embed_inputs(fb) if self.pp.is_first else hidden_in
        rope = {key: r.cos_sin(fb.positions, h.dtype) for key, r in self.rotary.items()}
        # image rows' own windows (AttentionMetadata.windowed) are read by the modules' attention
        windowed = fb.attn is not None and bool(fb.attn.windowed)
        for layer, p in zip(self.stage_layers, self.one_call_args, strict=True):
            if p is None or (windowed and p.consts.window):
                h = layer(h, fb, pool, rope)
            else:
                h = one_call.forward(p, h, fb, pool, rope)
        return self.norm(h[fb.logits_indices]) if self.pp.is_last else h

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] last-token rows -> [B, labels]: a yes/no reranker's logits of its label
        tokens, the same as those columns of compute_logits. Row by row, so that a score does
        not depend on what it was batched with (a matmul's blocking may change with B)."""
        return torch.cat([F.linear(row[None], self.label_rows) for row in pooled])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _on_this_stage(self, name: str) -> bool:
        if name.startswith("layers."):
            return self.start_layer <= int(name.split(".")[1]) < self.end_layer
        if name.startswith("embed_tokens."):
            return hasattr(self, "embed_tokens")
        return self.pp.is_last  # norm, lm_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockWeight]]) -> set[str]:
        """Float tensors are copied into the parameters (in their dtype); block weights are kept
        by their layers until `finish_loading`."""
        params = {n: p for n, p in self.named_parameters() if not n.startswith(self.other_params)}
        loaded: set[str] = set()
        for name, tensor in weights:
            # Multimodal Gemma 3 checkpoints nest the text model under language_model.
            name = name.removeprefix("language_model.").removeprefix("model.")
            if "rotary_emb" in name or (name.startswith("lm_head.") and self.cfg.tie_word_embeddings):
                continue
            shard: object | None = None
            for ckpt, (ours, shard_id) in STACKED_PARAMS.items():
                if ckpt in name:
                    name, shard = name.replace(ckpt, ours), shard_id
                    break
            if name not in params and not self._on_this_stage(name):
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            load_param(params[name], tensor, shard)
            loaded.add(name)
        return all_loaded(params, loaded)

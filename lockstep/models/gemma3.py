"""Gemma 3 (text): interleaved sliding/global attention with their own RoPE bases, q/k norms,
(1 + w) RMSNorms before and after both attention and MLP, scaled embeddings, GeGLU, tied head."""

from __future__ import annotations

import torch

from lockstep.configs.model_config import ModelConfig
from lockstep.distributed.parallel_state import NO_PIPELINE, ParallelGroup, PipelineGroup
from lockstep.forward_batch import ForwardBatch
from lockstep.layers.norm import add_norm
from lockstep.mem_cache.memory_pool import TokenToKVPool
from lockstep.models.llama import LlamaDecoderLayer, LlamaForCausalLM, RopeTables


class Gemma3DecoderLayer(LlamaDecoderLayer):
    gemma_norms = True

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_id, tp, dtype)
        self.pre_feedforward_layernorm = self.norm(cfg, dtype)
        self.post_feedforward_layernorm = self.norm(cfg, dtype)

    def forward(self, h: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool,
                rope: RopeTables) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), fb, pool, rope)
        h, x = add_norm(h, a, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return add_norm(h, self.mlp(x), self.post_feedforward_layernorm, None)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype,
                 pp: PipelineGroup = NO_PIPELINE) -> None:
        super().__init__(cfg, tp, dtype, pp)
        # HF rounds the scale to the model dtype before multiplying; so do we.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

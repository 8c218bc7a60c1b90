from __future__ import annotations

import torch
from torch import nn

from lockstep.configs.model_config import ModelConfig
from lockstep.distributed.parallel_state import NO_PIPELINE, ParallelGroup, PipelineGroup
from lockstep.models.bert import BertModel
from lockstep.models.gemma3 import Gemma3ForCausalLM
from lockstep.models.gemma3_mm import Gemma3ForConditionalGeneration
from lockstep.models.idefics3 import Idefics3ForConditionalGeneration
from lockstep.models.llama import LlamaForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    **dict.fromkeys(("llama", "qwen2", "qwen3"), LlamaForCausalLM), "gemma3": Gemma3ForCausalLM,
    "gemma3+vision": Gemma3ForConditionalGeneration,
    "idefics3+vision": Idefics3ForConditionalGeneration, "bert": BertModel}


def build_model(cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype,
                pp: PipelineGroup = NO_PIPELINE) -> nn.Module:
    return MODELS[cfg.model_key](cfg, tp, dtype, pp)

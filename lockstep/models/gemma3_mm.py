"""Gemma 3 with images (HF's Gemma3ForConditionalGeneration): the text model of models/gemma3.py,
whose image tokens take the SigLIP tower's features, pooled to `tokens_per_image`, RMS-normed
and projected to the text width. The encoder cache, the image rows and the loading are every
image model's (models/image_text.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.configs.model_config import ModelConfig
from lockstep.configs.vision_config import VisionConfig
from lockstep.distributed.parallel_state import NO_PIPELINE, ParallelGroup, PipelineGroup
from lockstep.layers.linear import ColumnParallelLinear
from lockstep.layers.norm import RMSNorm
from lockstep.models.gemma3 import Gemma3ForCausalLM
from lockstep.models.image_text import ImageTextModel
from lockstep.models.siglip import SiglipVisionTower

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class Gemma3Projector(nn.Module):
    """Average-pool the patch grid to tokens_per_image, Gemma's (1 + w) RMSNorm, project."""

    def __init__(self, v: VisionConfig, text_hidden: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.side = v.patches_per_side
        self.kernel = self.side // int(v.tokens_per_image**0.5)
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, v.layer_norm_eps, dtype, gemma=True)
        # HF keeps the projection as a [vision, text] matrix multiplied from the right: a linear
        # of its transpose, split by output columns like any column-parallel layer.
        self.proj = ColumnParallelLinear(v.hidden_size, text_hidden, False, tp, dtype)
        self.tp = tp

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[patches, vision hidden] -> [tokens_per_image, text hidden]"""
        grid = patches.transpose(0, 1).reshape(1, -1, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].transpose(0, 1)
        return self.tp.all_gather(self.proj(self.mm_soft_emb_norm(pooled.contiguous())), dim=-1)


class Gemma3ForConditionalGeneration(ImageTextModel, Gemma3ForCausalLM):
    other_params = VISION_PREFIXES

    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype,
                 pp: PipelineGroup = NO_PIPELINE) -> None:
        super().__init__(cfg, tp, dtype, pp)
        v = cfg.vision
        assert v is not None  # the registry builds this class only for a config with vision
        if pp.is_first:  # only the first pipeline stage embeds, so only it holds the tower
            self.vision_tower = SiglipVisionTower(v, tp, dtype)
            self.multi_modal_projector = Gemma3Projector(v, cfg.hidden_size, tp, dtype)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, H, W] -> [tokens_per_image, hidden]"""
        dev = self.multi_modal_projector.mm_soft_emb_norm.weight.device
        return self.multi_modal_projector(self.vision_tower(pixels.to(dev)))

    def checkpoint_name(self, name: str) -> str:
        # transformers 5 names (model.vision_tower.*, model.language_model.*) and the original
        # checkpoints' (vision_tower.vision_model.*, language_model.model.*)
        return name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")

    def vision_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("vision_tower.head."):
            return None  # SigLIP's pooling head: Gemma 3 reads the patch features, not the head
        if name == "multi_modal_projector.mm_input_projection_weight":
            return "multi_modal_projector.proj.weight", tensor.t()
        return name, tensor

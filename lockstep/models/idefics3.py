"""Idefics3 / SmolVLM with images (HF's Idefics3ForConditionalGeneration): a Llama text model
(models/llama.py) whose image tokens take, tile by tile, a SigLIP-style tower's patch features
(models/siglip.py, with Idefics3's NaViT position ids), pixel-shuffled by `scale_factor` (each
scale_factor x scale_factor block of patches becomes one token of scale_factor**2 times the width)
and projected by a bias-free linear to the text width. An image is its tiles (rows x cols crops and
a global view, or the global view alone), each `tokens_per_image` tokens; the front lays them out
as HF's processor does (lockstep.multimodal.processing). The encoder cache, the image rows and the
loading are every image model's (models/image_text.py)."""

from __future__ import annotations

import torch
from torch import nn

from lockstep.configs.model_config import ModelConfig
from lockstep.configs.vision_config import VisionConfig
from lockstep.distributed.parallel_state import NO_PIPELINE, ParallelGroup, PipelineGroup
from lockstep.layers.linear import ColumnParallelLinear
from lockstep.models.image_text import ImageTextModel
from lockstep.models.llama import LlamaForCausalLM
from lockstep.models.siglip import SiglipVisionTower

VISION_PREFIXES = ("vision_model.", "connector.")


def navit_position_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """Each patch's row of the position table for a rows x cols patch grid of a tower trained at
    side x side, computed as HF's Idefics3VisionEmbeddings does for an unpadded image (the same
    float32 arithmetic: its bucketing decides the ids, even at the trained size)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)

    def buckets(n: int) -> torch.Tensor:
        step = 1.0 / torch.tensor([n])  # float32, as HF's per-image 1.0 / nb_patches
        frac = torch.arange(n, dtype=torch.float32)[None, :] * step[:, None]
        return torch.bucketize(torch.clamp(frac, max=1.0 - 1e-6), boundaries, right=True)[0]

    return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)


class Idefics3Connector(nn.Module):
    """HF's pixel shuffle then `modality_projection.proj`, a bias-free linear (column-parallel,
    gathered, as Gemma 3's projector)."""

    def __init__(self, v: VisionConfig, text_hidden: int, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = v.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = ColumnParallelLinear(
            v.hidden_size * self.scale**2, text_hidden, False, tp, dtype)
        self.tp = tp

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[patches, d] of a square patch grid -> [patches / s**2, d * s**2], HF's reshapes."""
        seq, d, s = x.shape[0], x.shape[1], self.scale
        side = int(seq**0.5)
        x = x.view(side, side // s, d * s).transpose(0, 1)
        x = x.reshape(side // s, side // s, d * s * s).transpose(0, 1)
        return x.reshape(seq // (s * s), d * s * s)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        shuffled = self.pixel_shuffle(patches).contiguous()
        return self.tp.all_gather(self.modality_projection.proj(shuffled), dim=-1)


class Idefics3ForConditionalGeneration(ImageTextModel, LlamaForCausalLM):
    other_params = VISION_PREFIXES

    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype,
                 pp: PipelineGroup = NO_PIPELINE) -> None:
        super().__init__(cfg, tp, dtype, pp)
        v = cfg.vision
        assert v is not None  # the registry builds this class only for a config with vision
        self.patch, self.side = v.patch_size, v.patches_per_side
        if pp.is_first:  # only the first pipeline stage embeds, so only it holds the tower
            self.vision_model = SiglipVisionTower(v, tp, dtype)
            self.connector = Idefics3Connector(v, cfg.hidden_size, tp, dtype)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, H, W] -> [tiles * tokens_per_image, hidden]: one tile at a time (so a tile's
        features never depend on its neighbours), in the processor's tile order."""
        dev = self.vision_model.post_layernorm.weight.device
        rows, cols = pixels.shape[-2] // self.patch, pixels.shape[-1] // self.patch
        pos = navit_position_ids(rows, cols, self.side).to(dev)
        return torch.cat([self.connector(self.vision_model(tile.to(dev), pos)) for tile in pixels])

    def checkpoint_name(self, name: str) -> str:
        # model.vision_model.*, model.connector.*, model.text_model.* and lm_head.* (the
        # original checkpoints' names and transformers 5's are the same)
        return name.removeprefix("model.").removeprefix("text_model.")

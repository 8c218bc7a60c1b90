"""Gemma 3 with images (HF's Gemma3ForConditionalGeneration): the text model of models/gemma3.py,
whose image tokens take the SigLIP tower's features, pooled to `tokens_per_image`, RMS-normed
and projected to the text width. Features are computed once per image content hash and kept in
the encoder cache (lockstep.multimodal.encoder_cache); pixels come from shared memory by handle."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.configs.model_config import ModelConfig
from lockstep.configs.vision_config import VisionConfig
from lockstep.distributed.parallel_state import NO_PIPELINE, ParallelGroup, PipelineGroup
from lockstep.forward_batch import ForwardBatch
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.linear import ColumnParallelLinear
from lockstep.layers.norm import RMSNorm
from lockstep.models.gemma3 import Gemma3ForCausalLM
from lockstep.models.siglip import SiglipVisionTower
from lockstep.multimodal.encoder_cache import EncoderCache
from lockstep.multimodal.refs import ImageRef
from lockstep.multimodal.shm import read_pixels

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


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    other_params = VISION_PREFIXES

    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype,
                 pp: PipelineGroup = NO_PIPELINE) -> None:
        super().__init__(cfg, tp, dtype, pp)
        v = cfg.vision
        assert v is not None  # the registry builds this class only for a config with vision
        if pp.is_first:  # only the first pipeline stage embeds, so only it holds the tower
            self.vision_tower = SiglipVisionTower(v, tp, dtype)
            self.multi_modal_projector = Gemma3Projector(v, cfg.hidden_size, tp, dtype)
        # Every rank of a replica sees the same batches in the same order, so their caches hit and
        # miss alike (a tensor-parallel tower's collectives need every rank to run it).
        self.encoder_cache = EncoderCache()

    def image_features(self, image: ImageRef) -> torch.Tensor:
        """[tokens_per_image, hidden] of an image: from the cache, or the tower run once."""
        feats = self.encoder_cache.get(image.digest)
        if feats is None:
            pixels = read_pixels(image.shm_name, image.shape)
            dev = self.multi_modal_projector.mm_soft_emb_norm.weight.device
            feats = self.multi_modal_projector(self.vision_tower(pixels.to(dev)))
            self.encoder_cache.put(image.digest, feats)
        return feats

    def embed_inputs(self, fb: ForwardBatch) -> torch.Tensor:
        # Image tokens carry ids past the vocabulary (hash-derived, for the prefix tree): their
        # rows are embedded as token 0, then replaced by the image's features.
        ids = fb.input_ids
        h = self.embed(torch.where(ids < self.cfg.vocab_size, ids, 0))
        for r in fb.images:
            h[r.row:r.row + r.count] = self.image_features(r.image)[r.first:r.first + r.count].to(h.dtype)
        return h

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockWeight]]) -> set[str]:
        vision: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterable[tuple[str, torch.Tensor | BlockWeight]]:
            for name, tensor in weights:
                # transformers 5 names (model.vision_tower.*, model.language_model.*) and the
                # original checkpoints' (vision_tower.vision_model.*, language_model.model.*)
                name = name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
                if name.startswith(VISION_PREFIXES):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        loaded = super().load_weights(text())
        return loaded | self._load_vision(vision)

    def _load_vision(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        if not self.pp.is_first:
            return set()
        params = {n: p for n, p in self.named_parameters() if n.startswith(VISION_PREFIXES)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if isinstance(tensor, BlockWeight):
                tensor = tensor.dequantize()
            shard: str | None = None
            if name.startswith("vision_tower.head."):
                continue  # SigLIP's pooling head: Gemma 3 reads the patch features, not the head
            if name == "multi_modal_projector.mm_input_projection_weight":
                name, tensor = "multi_modal_projector.proj.weight", tensor.t()
            for proj in ("q", "k", "v"):
                if f".self_attn.{proj}_proj." in name:
                    name, shard = name.replace(f".{proj}_proj.", ".qkv_proj."), proj
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            param = params[name]
            with torch.no_grad():
                tensor = tensor.to(param.dtype)
                loader = param.weight_loader  # type: ignore[attr-defined]
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"checkpoint is missing vision tensors: {sorted(missing)[:8]}")
        return loaded

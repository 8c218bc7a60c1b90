"""What every model that reads images shares (Gemma 3's, Idefics3's), mixed in before its text
model's class: an image's features by content hash from the encoder cache (the family's tower and
connector run once per distinct image, on pixels read from shared memory by handle), the batch's
image rows taking them in the input embeddings, and loading the tower's and connector's weights
beside the text model's. A family says only how pixels become features (`encode_image`) and how
its checkpoint names its tensors (`checkpoint_name`, `vision_tensor`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lockstep.configs.model_config import ModelConfig
from lockstep.distributed.parallel_state import NO_PIPELINE, ParallelGroup, PipelineGroup
from lockstep.forward_batch import ForwardBatch
from lockstep.layers.block_weight import BlockWeight
from lockstep.layers.weight_loading import all_loaded, load_param
from lockstep.multimodal.encoder_cache import EncoderCache
from lockstep.multimodal.refs import ImageRef
from lockstep.multimodal.shm import read_pixels


class ImageTextModel(nn.Module):
    """Mixed in before a text model class (LlamaForCausalLM or a subclass), whose `other_params`
    names the vision parameters' prefixes: the text model's loader leaves them to this one."""

    cfg: ModelConfig
    pp: PipelineGroup
    other_params: tuple[str, ...]

    def __init__(self, cfg: ModelConfig, tp: ParallelGroup, dtype: torch.dtype,
                 pp: PipelineGroup = NO_PIPELINE) -> None:
        super().__init__(cfg, tp, dtype, pp)  # type: ignore[call-arg]  # the text model's
        # Every rank of a replica sees the same batches in the same order, so their caches hit and
        # miss alike (a tensor-parallel tower's collectives need every rank to run it).
        self.encoder_cache = EncoderCache()

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """[feature rows, text hidden] of one image's float32 pixels, as the front wrote them."""
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as ours: under `other_params` for the tower and connector,
        else as the text model's load_weights takes it."""
        raise NotImplementedError

    def vision_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """A vision tensor renamed or reshaped to its parameter; None: the model does not use it."""
        return name, tensor

    def image_features(self, image: ImageRef) -> torch.Tensor:
        """The image's feature rows: from the cache, or the tower run once."""
        feats = self.encoder_cache.get(image.digest)
        if feats is None:
            feats = self.encode_image(read_pixels(image.shm_name, image.shape))
            self.encoder_cache.put(image.digest, feats)
        return feats

    def embed_inputs(self, fb: ForwardBatch) -> torch.Tensor:
        # Image tokens carry ids past the vocabulary (hash-derived, for the prefix tree): their
        # rows are embedded as token 0, then replaced by the image's features.
        ids = fb.input_ids
        h = self.embed(torch.where(ids < self.cfg.vocab_size, ids, 0))  # type: ignore[attr-defined]
        feats: dict[str, torch.Tensor] = {}  # one lookup per image a pass, however many runs it has
        for r in fb.images:
            f = feats.get(r.image.digest)
            if f is None:
                f = feats[r.image.digest] = self.image_features(r.image)
            h[r.row:r.row + r.count] = f[r.first:r.first + r.count].to(h.dtype)
        return h

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockWeight]]) -> set[str]:
        vision: list[tuple[str, torch.Tensor | BlockWeight]] = []

        def text() -> Iterable[tuple[str, torch.Tensor | BlockWeight]]:
            for name, tensor in weights:
                name = self.checkpoint_name(name)
                if name.startswith(self.other_params):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        loaded = super().load_weights(text())  # type: ignore[misc]  # the text model's
        return loaded | self._load_vision(vision)

    def _load_vision(self, weights: list[tuple[str, torch.Tensor | BlockWeight]]) -> set[str]:
        if not self.pp.is_first:  # only the first pipeline stage embeds, so only it holds the tower
            return set()
        params = {n: p for n, p in self.named_parameters() if n.startswith(self.other_params)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if isinstance(tensor, BlockWeight):
                tensor = tensor.dequantize()
            renamed = self.vision_tensor(name, tensor)
            if renamed is None:
                continue
            name, tensor = renamed
            shard: str | None = None
            for proj in ("q", "k", "v"):
                if f".self_attn.{proj}_proj." in name:
                    name, shard = name.replace(f".{proj}_proj.", ".qkv_proj."), proj
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            load_param(params[name], tensor, shard)
            loaded.add(name)
        return all_loaded(params, loaded, "vision tensors")

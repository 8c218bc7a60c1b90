"""SigLIP's vision tower (Gemma 3's image encoder, and Idefics3's with NaViT position ids) on
lockstep's layers: patch embedding, encoder layers of bidirectional attention (q/k/v column-parallel
over heads, the out projection row-parallel, as the text model's) and a GELU MLP, LayerNorms, a
final LayerNorm. One image at a time, so an image's features never depend on what it is batched
with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.configs.vision_config import VisionConfig
from lockstep.distributed.parallel_state import ParallelGroup
from lockstep.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    _copy,
    _param,
)

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


def replicated(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A parameter every rank holds whole (norms, position and patch embeddings)."""
    return _param(shape, dtype, lambda p, loaded: _copy(p, loaded, "vision weight"))


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight, self.bias = replicated((dim,), dtype), replicated((dim,), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class SiglipAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.hidden_size // cfg.num_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_heads, True, tp, dtype)
        self.out_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, True, tp, dtype)
        self.heads, self.head_dim, self.scaling = self.qkv_proj.n_heads_local, d, d**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [patches, hidden] of one image."""
        n = x.shape[0]
        q, k, v = (t.view(n, self.heads, self.head_dim).transpose(0, 1)
                   for t in self.qkv_proj.split(self.qkv_proj(x)))
        probs = (torch.matmul(q, k.transpose(-1, -2)) * self.scaling).softmax(-1, dtype=torch.float32)
        out = torch.matmul(probs.to(q.dtype), v).transpose(0, 1).reshape(n, self.heads * self.head_dim)
        return self.out_proj(out)


class SiglipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp, dtype)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, dtype)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.self_attn = SiglipAttention(cfg, tp, dtype)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = SiglipMLP(cfg, tp, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.mlp(self.layer_norm2(h))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch = cfg.patch_size
        self.patch_embedding = nn.Module()  # HF's Conv2d names: patch_embedding.weight / .bias
        self.patch_embedding.weight = replicated((cfg.hidden_size, 3, cfg.patch_size, cfg.patch_size), dtype)
        self.patch_embedding.bias = replicated((cfg.hidden_size,), dtype)
        self.position_embedding = nn.Module()
        self.position_embedding.weight = replicated((cfg.patches_per_side**2, cfg.hidden_size), dtype)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """pixels: [3, H, W] -> [patches, hidden]; position_ids: each patch's row of the position
        table (None: the whole table in order, for the image size the tower was trained at)."""
        w = self.patch_embedding.weight
        x = F.conv2d(pixels[None].to(w.dtype), w, self.patch_embedding.bias, stride=self.patch)
        table = self.position_embedding.weight
        return x.flatten(2)[0].transpose(0, 1) + (table if position_ids is None else table[position_ids])


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(cfg, tp, dtype) for _ in range(cfg.num_layers))
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embeddings(pixels, position_ids)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)

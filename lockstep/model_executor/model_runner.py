"""Owns the model, its weights and the KV pools on one rank; runs one forward pass."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from lockstep.configs.model_config import ModelConfig
from lockstep.distributed.parallel_state import NO_PIPELINE, SINGLE, ParallelGroup, PipelineGroup
from lockstep.forward_batch import ForwardBatch
from lockstep.lora.layers import LoraLayers
from lockstep.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from lockstep.model_executor.weight_setup import load_model_weights
from lockstep.model_loader.source import ModelSource
from lockstep.models.registry import build_model
from lockstep.multimodal.encoder_cache import EncoderStats
from lockstep.utils.process import keep_freed_memory

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """auto: float32 on a CPU, where the block kernels take float32 activations and a request's
    numbers do not depend on its batch (torch's bfloat16 matmuls there change greedy outputs
    between alone and batched: docs/benchmarks_archive.md, "bf16 vs float32 agreement"); bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def kv_cache_dtype(name: torch.dtype | None, dtype: torch.dtype, int8_activations: bool) -> torch.dtype:
    """The K/V pool's type. auto (None): float16 where int8 activations are on, as llama.cpp keeps its
    KV cache (batched decode attention reads every request's K/V from memory each step, so half the
    bytes is a large share of the step: docs/benchmarks.md, "Zen 4, night: the newest round in full");
    else the model's dtype, so the exact float32 path stays float32 end to end (the HF-equality
    oracle). A 16-bit pool rounds each K/V value once, on write: no request's numbers depend on its
    batch either way."""
    if name is not None:
        return name
    return torch.float16 if int8_activations else dtype


@dataclass(frozen=True)
class RunnerConfig:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.2
    max_running_requests: int = 64
    context_length: int | None = None
    # Ranks that share this machine's memory (they split the KV budget).
    local_ranks: int = 1
    quantization: str | None = None  # --quantization: pack a float checkpoint into blocks
    int8_activations: bool | None = None  # --int8-activations; None: on where it applies
    kv_cache_dtype: torch.dtype | None = None  # --kv-cache-dtype; None (auto): see kv_cache_dtype()


@dataclass
class PipelineStats:
    """What this stage ran, for tests and debugging: micro-batch counts prove the split, and
    max_sends_in_flight > 1 proves this stage went on computing while earlier slices were still
    on their way to (or being worked on by) the next stage, without any timing."""

    steps: int = 0
    micro_batches: int = 0
    last_step_micro_batches: int = 0
    max_sends_in_flight: int = 0

    def record(self, n: int) -> None:
        self.steps += 1
        self.micro_batches += n
        self.last_step_micro_batches = n


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, source: ModelSource, cfg: RunnerConfig,
                 tp: ParallelGroup = SINGLE, pp: PipelineGroup = NO_PIPELINE) -> None:
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.tp = tp
        self.pp = pp
        self.device = cfg.device
        self.dtype = cfg.dtype
        if cfg.device == "cpu":
            keep_freed_memory()  # the head's logits reuse one block of memory step after step
        t0 = time.perf_counter()
        with torch.device(cfg.device):
            self.model = build_model(model_cfg, tp, cfg.dtype, pp)
        # which kernel multiplies each weight, decided once here (its summary: /get_server_info)
        self.weight_plan = load_model_weights(self.model, source, cfg.quantization, cfg.dtype,
                                              cfg.device, cfg.int8_activations)
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, cfg.dtype, self.weight_plan.target.int8_activations)
        self.model.eval()
        logger.info("weights loaded in %.1f s", time.perf_counter() - t0)
        self.context_len = min(cfg.context_length or model_cfg.context_limit, model_cfg.context_limit)
        attn = self.model.layers[self.model.start_layer].self_attn
        self.n_kv_local = attn.n_kv
        self.max_total_tokens = self._kv_budget()
        row_len = min(self.context_len, self.max_total_tokens) + 1
        self.req_to_token_pool = ReqToTokenPool(cfg.max_running_requests + 1, row_len, cfg.device)
        layer_ids = range(self.model.start_layer, self.model.end_layer)
        self.token_to_kv_pool = TokenToKVPool(self.max_total_tokens, layer_ids,
                                              self.n_kv_local, model_cfg.head_dim, self.kv_dtype, cfg.device)
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, cfg.device)
        self.windows = set(model_cfg.layer_windows)
        self.pp_stats = PipelineStats()
        self.lora: LoraLayers | None = None  # with --enable-lora (lockstep.lora.manager sets it)

    @property
    def encoder_stats(self) -> EncoderStats | None:
        """The vision tower's runs and cache hits, for a model that reads images on one stage
        (with pipeline stages the first encodes and the last reports: None there)."""
        cache = getattr(self.model, "encoder_cache", None)
        return cache.stats if cache is not None and self.pp.size == 1 else None

    def _kv_budget(self) -> int:
        if self.cfg.max_total_tokens:
            return self.cfg.max_total_tokens
        n_layers = self.model.end_layer - self.model.start_layer
        per_token = TokenToKVPool.bytes_per_token(n_layers, self.n_kv_local,
                                                  self.model_cfg.head_dim, self.kv_dtype)
        free = (torch.cuda.mem_get_info()[0] if self.device == "cuda"
                else psutil.virtual_memory().available // self.cfg.local_ranks)
        tokens = int(free * self.cfg.mem_fraction_static) // per_token
        # More KV than every running request could fill at full context is wasted memory.
        return max(256, min(tokens, self.context_len * self.cfg.max_running_requests))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Final hidden states at fb.logits_indices on the last pipeline stage (the worker turns
        the rows it needs into logits); None on earlier stages, which pass hidden states on."""
        return self.forward_micro_batches([fb])

    @torch.inference_mode()
    def forward_micro_batches(self, parts: list[ForwardBatch]) -> torch.Tensor | None:
        """Run consecutive slices of one batch through this stage, in order (GPipe within one
        scheduler step). Each slice's hidden states leave with a non-blocking send, so this
        stage starts the next slice while the next stage works on this one. The last stage
        returns the slices' hidden rows concatenated: the rows of the whole batch, in order."""
        recvs = self._post_recvs(parts) if not self.pp.is_first else []
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        outs: list[torch.Tensor] = []
        for i, fb in enumerate(parts):
            fb.build_attention(self.req_to_token_pool.req_to_token, self.windows)
            if self.lora is not None:
                self.lora.prepare(fb)
            hidden_in = None
            if recvs:
                hidden_in, work = recvs[i]
                work.wait()
            hidden = self.model(fb, self.token_to_kv_pool, hidden_in)
            if self.pp.is_last:
                outs.append(hidden)
                continue
            hidden = hidden.contiguous()
            # The tensor stays referenced until its send is waited: freed early, its memory
            # could be reused while the transport still reads it.
            sends.append((dist.isend(hidden, dst=self.pp.next_global, tag=i), hidden))
            self.pp_stats.max_sends_in_flight = max(self.pp_stats.max_sends_in_flight, len(sends))
        for work, _ in sends:
            work.wait()
        self.pp_stats.record(len(parts))
        if not self.pp.is_last:
            return None
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _post_recvs(self, parts: list[ForwardBatch]) -> list[tuple[torch.Tensor, dist.Work]]:
        """Receives for every slice, posted up front so slice i+1 arrives while i computes.
        Every stage made the same scheduling decision and split, so the shapes are known here;
        the tag is the slice number, which keeps the messages apart."""
        posted = []
        for i, fb in enumerate(parts):
            buf = torch.empty((fb.input_ids.numel(), self.model_cfg.hidden_size),
                              dtype=self.dtype, device=self.device)
            posted.append((buf, dist.irecv(buf, src=self.pp.prev_global, tag=i)))
        return posted

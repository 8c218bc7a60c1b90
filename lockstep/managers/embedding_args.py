"""How a scheduler runs a model that pools (embeds or scores) instead of generating."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lockstep.configs.model_config import ModelConfig
from lockstep.model_loader.pooling import Pooling, separator_id
from lockstep.server_args import ServerArgs


def embedding_args(args: ServerArgs) -> ServerArgs:
    """`args` for a pooling model's scheduler, as SGLang runs its embedding models: every prompt
    in one pass (no chunking: an encoder's rows attend to the whole prompt, and mean pooling reads
    every row), no prefix cache (an encoder's K/V at a position depends on the tokens after it,
    so a shared prefix is not a shared computation; a pooled request keeps no KV after it), and
    no overlap thread or speculation (a pooled request is one prefill; nothing decodes)."""
    if args.pp_size > 1:
        raise ValueError("embedding and scoring models run with --pp-size 1")
    return dataclasses.replace(args, chunked_prefill_size=-1, disable_radix_cache=True,
                               enable_overlap_schedule=False, speculative_algorithm="NONE")


def pooling_config(cfg: ModelConfig, model_dir: Path, pooling: Pooling) -> ModelConfig:
    """A pooling model's config with what its files say beside config.json: an encoder's
    separator id, where config.json has none (BERT checkpoints rarely do: the token a pair's
    second segment starts after), and a yes/no reranker's label tokens (its classifier rows)."""
    if pooling.label_tokens:
        cfg = dataclasses.replace(cfg, label_token_ids=pooling.label_tokens)
    if cfg.causal or cfg.sep_token_id is not None:
        return cfg
    return dataclasses.replace(cfg, sep_token_id=separator_id(model_dir))

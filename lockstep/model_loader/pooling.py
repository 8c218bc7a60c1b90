"""What a model serves, read once from its files: tokens ("generate"), a pooled vector ("embed")
or a relevance score ("score"), and for the last two how the vector is pooled.

- A sentence-transformers directory says it in `modules.json`: a Pooling module (its
  `1_Pooling/config.json` names mean / CLS / last-token pooling) and a Normalize module.
- A `*ForSequenceClassification` architecture is a cross-encoder: [CLS] through its classifier.
- Any other encoder (BERT) embeds ([CLS], normalized: SGLang's default for BERT).
- A decoder embeds only when asked (`--is-embedding`): its last token, normalized (the
  Qwen3-Embedding recipe)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.model_loader.layout import ModelLoadError

ENCODERS = frozenset({"bert", "roberta", "xlm-roberta"})  # model_type values of bidirectional encoders
POOLING_MODES = ("mean", "cls", "last")
# 1_Pooling/config.json's flags, in the order sentence-transformers checks them
_ST_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class Pooling:
    mode: str  # "mean", "cls" or "last"
    normalize: bool  # L2-normalize the pooled vector
    classify: bool = False  # the model's classifier turns the pooled row into scores (rerank)
    # Matryoshka models (config.json's matryoshka_dimensions): the sizes a vector may be cut to
    dimensions: tuple[int, ...] | None = None

    @property
    def kind(self) -> str:
        return "score" if self.classify else "embed"


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable: {e}") from e


def _sentence_transformers(model_dir: Path) -> Pooling | None:
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return None
    entries = _read(modules)
    if not isinstance(entries, list):
        raise ModelLoadError(f"{modules}: expected a list of modules")
    types = {str(e.get("type", "")).rsplit(".", 1)[-1]: e for e in entries if isinstance(e, dict)}
    if "Pooling" not in types:
        return None
    config = _read(model_dir / str(types["Pooling"].get("path", "")) / "config.json")
    on = [mode for flag, mode in _ST_FLAGS.items() if isinstance(config, dict) and config.get(flag)]
    others = [k for k, v in (config.items() if isinstance(config, dict) else ())
              if k.startswith("pooling_mode") and v and k not in _ST_FLAGS]
    if len(on) != 1 or others:
        raise ModelLoadError(f"{model_dir}: pooling {on + others} is not supported; lockstep "
                             f"pools by one of {', '.join(POOLING_MODES)}")
    return Pooling(on[0], normalize="Normalize" in types)


def pooling_for(model_dir: Path, hf_config: dict[str, Any], is_embedding: bool) -> Pooling | None:
    """How the model pools, or None for a model that generates. The one decision of a model's
    kind: the scheduler builds its last step from it, the front its routes."""
    archs = hf_config.get("architectures") or ()
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        return Pooling("cls", normalize=False, classify=True)
    dims = hf_config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else None
    pooling = _sentence_transformers(model_dir)
    if pooling is None and hf_config.get("model_type") in ENCODERS:
        pooling = Pooling("cls", normalize=True)
    if pooling is None and is_embedding:
        pooling = Pooling("last", normalize=True)
    return None if pooling is None else dataclasses.replace(pooling, dimensions=dims)


def model_kind(pooling: Pooling | None) -> str:
    return "generate" if pooling is None else pooling.kind


def separator_id(model_dir: Path) -> int | None:
    """The id of the tokenizer's separator token ([SEP]), which splits a BERT pair into its two
    segments (models/bert.py): tokenizer_config.json or special_tokens_map.json name it,
    tokenizer.json holds its id. None where the files do not say."""
    name = None
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / file).is_file():
            sep = (_read(model_dir / file) or {}).get("sep_token")
            name = sep.get("content") if isinstance(sep, dict) else sep
            if name:
                break
    if not name or not (model_dir / "tokenizer.json").is_file():
        return None
    tok = _read(model_dir / "tokenizer.json")
    for added in tok.get("added_tokens") or ():
        if added.get("content") == name:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    return int(vocab[name]) if isinstance(vocab, dict) and name in vocab else None

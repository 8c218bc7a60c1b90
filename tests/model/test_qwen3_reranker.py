"""Decoder rerankers that score by the logits of "yes" and "no" (Qwen3-Reranker) against HF
transformers: a tiny random-weight Qwen3 whose directory is named as a Qwen3-Reranker, each pair
in the model card's prompt, p(yes) = softmax([logit_no, logit_yes])[1] at the last position as
transformers' Qwen3ForCausalLM computes it; a score's bits alone and in a batch; how a checkpoint
is found to be one (docs/embeddings.md)."""

from __future__ import annotations

import pytest
import torch

from lockstep.entrypoints.openai.chat_templates import reranker_prompt
from lockstep.model_loader import resolve_model
from lockstep.model_loader.layout import ModelLoadError
from lockstep.model_loader.pooling import Pooling, pooling_for
from lockstep.testing.embedding_oracle import embed_in_process
from lockstep.testing.inproc import make_scheduler
from lockstep.testing.reranker_oracle import card_prompt, tokenizer, transformers_p_yes
from lockstep.testing.tiny_encoders import make_tiny_encoder
from lockstep.testing.tiny_models import make_tiny_model, make_tiny_yes_no_reranker

QUERY = "what do pandas eat"
DOCS = ["The giant panda eats bamboo shoots and leaves.", "Paris is the capital of France.",
        "hi", "The river bends twice before it reaches the sea, and the old mill stands there."]
INSTRUCT = "Given a question, find the passage that answers it"


def test_the_prompt_is_the_model_cards() -> None:
    for instruct in (None, INSTRUCT):
        assert reranker_prompt(QUERY, DOCS[0], instruct) == card_prompt(QUERY, DOCS[0], instruct)


@pytest.mark.parametrize("tied", [False, True])
def test_scores_are_transformers_p_yes(tied: bool) -> None:
    """p(yes) of each pair, with the default and a given instruction, to float32 rounding, in
    the same order; and each score's bits the same alone and among the others."""
    path = make_tiny_yes_no_reranker(tied)
    tok = tokenizer(str(path))
    sched = make_scheduler(path)
    for instruct in (None, INSTRUCT):
        ids = [tok(reranker_prompt(QUERY, d, instruct)).input_ids for d in DOCS]
        logits = embed_in_process(sched, ids, prefix=f"{instruct}-")
        ours = [torch.softmax(torch.tensor(row), 0)[1].item() for row in logits]
        ref = transformers_p_yes(path, QUERY, DOCS, instruct)
        assert all(len(row) == 2 for row in logits)
        assert max(abs(a - b) for a, b in zip(ours, ref)) < 2e-6, (ours, ref)
        assert sorted(range(len(DOCS)), key=lambda i: -ours[i]) == sorted(
            range(len(DOCS)), key=lambda i: -ref[i])
        assert len({round(s, 3) for s in ours}) == len(DOCS)  # the pairs' scores differ
        alone = [embed_in_process(sched, [p], prefix=f"{instruct}-a{i}-")[0] for i, p in enumerate(ids)]
        assert alone == logits


def test_a_yes_no_reranker_is_found_by_its_name_or_its_prompt() -> None:
    """Its name ("qwen3-reranker" in the path) or --chat-template qwen3-reranker (SGLang's
    qwen3_reranker too) make a Qwen3 a reranker; a plain Qwen3 generates; the flags that
    contradict it are refused."""
    named = resolve_model(str(make_tiny_yes_no_reranker()))
    labels = Pooling("last", False, classify=True, label_tokens=(513, 512))
    assert pooling_for(named.model_dir, named.hf_config, False, named.origin) == labels
    assert pooling_for(named.model_dir, named.hf_config, False, named.origin, "qwen3-reranker") == labels
    plain = resolve_model(str(make_tiny_model("qwen3")))
    assert pooling_for(plain.model_dir, plain.hf_config, False, plain.origin) is None
    with pytest.raises(ModelLoadError, match="no token 'no'"):  # the tiny tokenizer has neither
        pooling_for(plain.model_dir, plain.hf_config, False, plain.origin, "qwen3_reranker")
    with pytest.raises(ModelLoadError, match="--is-embedding"):
        pooling_for(named.model_dir, named.hf_config, True, named.origin)
    with pytest.raises(ModelLoadError, match="chatml"):
        pooling_for(named.model_dir, named.hf_config, False, named.origin, "chatml")
    with pytest.raises(ModelLoadError, match="is a decoder"):
        pooling_for(make_tiny_encoder("embed-cls"), {"model_type": "bert"}, False, "",
                    "qwen3-reranker")

"""Decoder rerankers that score by the logits of "yes" and "no" (Qwen3-Reranker) against HF
transformers: a tiny random-weight Qwen3 whose directory is named as a Qwen3-Reranker, each pair
in the model card's prompt, p(yes) = softmax([logit_no, logit_yes])[1] at the last position as
transformers' Qwen3ForCausalLM computes it; a score's bits alone and in a batch; how a checkpoint
is found to be one (docs/embeddings.md)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from lockstep.entrypoints.openai.chat_templates import reranker_prompt
from lockstep.model_loader import resolve_model
from lockstep.model_loader.layout import ModelLoadError
from lockstep.model_loader.pooling import Pooling, pooling_for
from lockstep.testing.embedding_oracle import embed_in_process
from lockstep.testing.inproc import make_scheduler
from lockstep.testing.tiny_encoders import make_tiny_encoder
from lockstep.testing.tiny_models import make_tiny_model, make_tiny_yes_no_reranker

QUERY = "what do pandas eat"
DOCS = ["The giant panda eats bamboo shoots and leaves.", "Paris is the capital of France.",
        "hi", "The river bends twice before it reaches the sea, and the old mill stands there."]
INSTRUCT = "Given a question, find the passage that answers it"
# The model card's prompt, written out here as the card writes it (not through lockstep's template)
CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
               "Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
               "<|im_end|>\n<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"


def card_prompt(query: str, doc: str, instruct: str | None = None) -> str:
    return (f"{CARD_PREFIX}<Instruct>: {instruct or CARD_INSTRUCT}\n<Query>: {query}\n"
            f"<Document>: {doc}{CARD_SUFFIX}")


@functools.cache
def _tokenizer(path: str):  # noqa: ANN202
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def transformers_p_yes(path: Path, prompts: list[str]) -> list[float]:
    """The model card's score: the last position's logits of "no" and "yes", softmaxed."""
    from transformers import AutoModelForCausalLM

    tok = _tokenizer(str(path))
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for p in prompts:
            logits = hf(torch.tensor([tok(p).input_ids])).logits[0, -1]
            scores.append(torch.softmax(torch.stack([logits[no], logits[yes]]), 0)[1].item())
    return scores


def test_the_prompt_is_the_model_cards() -> None:
    for instruct in (None, INSTRUCT):
        assert reranker_prompt(QUERY, DOCS[0], instruct) == card_prompt(QUERY, DOCS[0], instruct)


@pytest.mark.parametrize("tied", [False, True])
def test_scores_are_transformers_p_yes(tied: bool) -> None:
    """p(yes) of each pair, with the default and a given instruction, to float32 rounding, in
    the same order; and each score's bits the same alone and among the others."""
    path = make_tiny_yes_no_reranker(tied)
    tok = _tokenizer(str(path))
    sched = make_scheduler(path)
    for instruct in (None, INSTRUCT):
        prompts = [card_prompt(QUERY, d, instruct) for d in DOCS]
        ids = [tok(reranker_prompt(QUERY, d, instruct)).input_ids for d in DOCS]
        logits = embed_in_process(sched, ids, prefix=f"{instruct}-")
        ours = [torch.softmax(torch.tensor(row), 0)[1].item() for row in logits]
        ref = transformers_p_yes(path, prompts)
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

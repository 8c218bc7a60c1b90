"""The oracle of a yes/no reranker (Qwen3-Reranker), shared by the in-process and the server
tests: the prompt as its model card (huggingface.co/Qwen/Qwen3-Reranker-0.6B) writes it, written
out here rather than through lockstep's template, and the card's score, p(yes) against p(no) at
the last position of transformers' Qwen3ForCausalLM."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
               "Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
               "<|im_end|>\n<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"


def card_prompt(query: str, doc: str, instruct: str | None = None) -> str:
    """The card's format_instruction between its prefix and suffix."""
    return (f"{CARD_PREFIX}<Instruct>: {instruct or CARD_INSTRUCT}\n<Query>: {query}\n"
            f"<Document>: {doc}{CARD_SUFFIX}")


@functools.cache
def tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def transformers_p_yes(path: Path, query: str, docs: list[str],
                       instruct: str | None = None) -> list[float]:
    """Each document's score as the card computes it: the last position's logits of "no" and
    "yes", softmaxed, the second."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer(str(path))
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for doc in docs:
            logits = hf(torch.tensor([tok(card_prompt(query, doc, instruct)).input_ids])).logits[0, -1]
            scores.append(torch.softmax(torch.stack([logits[no], logits[yes]]), 0)[1].item())
    return scores

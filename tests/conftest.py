from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from lockstep.testing.corpus import random_prompt
from lockstep.testing.tiny_models import TINY_ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs() -> dict:
    return {arch: make_tiny_model(arch) for arch in TINY_ARCHS}


def tiny_prompts(model_dir, n: int, seed: int = 0, min_words: int = 3, max_words: int = 30) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    return [tok(random_prompt(rng, rng.randint(min_words, max_words))).input_ids for _ in range(n)]

"""Fixtures the vision-model tests share; each test module defines its own `model_dir` (its tiny
model) and `hf_model` (the HF class that is its oracle)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from lockstep.multimodal.processing import ImageInputs
from lockstep.testing.image_oracle import front_inputs, held_segments


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def inputs(model_dir: Path, tok: Any) -> ImageInputs:
    """The front's image handling, as the server builds it for this model directory."""
    return front_inputs(model_dir, tok)


@pytest.fixture
def held() -> Iterator[list[Any]]:
    """Prepared images' shared-memory segments, unlinked after the test."""
    yield from held_segments()

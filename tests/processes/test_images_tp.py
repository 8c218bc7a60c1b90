"""Images with tensor, data and pipeline parallelism, through `lockstep.Engine(...).generate(image_data=...)`:
the vision tower and projector split over 2 ranks (column-parallel q/k/v and fc1, row-parallel
out/fc2 as in the text model) 2 replicas behind the DP controller and 3 pipeline stages give TP 1's greedy tokens,
with every rank's encoder cache hitting alike (the lockstep check compares the ranks' batches); and
Idefics3's under TP 2 and PP 3."""

from __future__ import annotations

import pytest

import lockstep
from lockstep.testing.tiny_idefics3 import make_tiny_idefics3_model
from lockstep.testing.tiny_vision import data_url, make_tiny_vision_model, random_image

pytestmark = pytest.mark.server  # launches scheduler ranks as processes

PROMPTS = ["<start_of_image> what is it", "a <start_of_image> b <start_of_image> c", "again <start_of_image>"]
SEEDS = [[1], [2, 3], [1]]


def _outputs(tp: int, dp: int = 1, pp: int = 1, model: str = "", prompts: list[str] = PROMPTS
             ) -> list[list[int]]:
    with lockstep.Engine(model_path=model or str(make_tiny_vision_model()), dtype="float32", tp_size=tp,
                         dp_size=dp, pp_size=pp, max_total_tokens=4096, enable_lockstep_check=2) as engine:
        outs = engine.generate(prompts, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                               image_data=[[data_url(random_image(s)) for s in seeds] for seeds in SEEDS])
    return [o["output_ids"] for o in outs]


def test_tp2_dp2_and_pp3_equal_tp1_with_images():
    tp1 = _outputs(1)
    assert len(tp1) == 3 and all(len(o) == 8 for o in tp1)
    assert _outputs(2) == tp1
    assert _outputs(1, dp=2) == tp1  # the DP controller routes image requests to either replica
    assert _outputs(1, pp=3) == tp1  # the first stage encodes; the text layers split 1/1/1


def test_idefics3_tp2_and_pp3_equal_tp1_with_images():
    """Idefics3's tiles: the tower and the connector's projection split over 2 ranks, or the first
    of 3 stages encoding, give TP 1's tokens."""
    model, prompts = str(make_tiny_idefics3_model()), [p.replace("<start_of_image>", "<image>") for p in PROMPTS]
    tp1 = _outputs(1, model=model, prompts=prompts)
    assert len(tp1) == 3 and all(len(o) == 8 for o in tp1)
    assert _outputs(2, model=model, prompts=prompts) == tp1
    assert _outputs(1, pp=3, model=model, prompts=prompts) == tp1

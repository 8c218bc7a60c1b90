"""Images with tensor and data parallelism: the vision tower and projector split over 2 ranks (column-
parallel q/k/v and fc1, row-parallel out/fc2 as in the text model) give TP 1's greedy tokens, with
every rank's encoder cache hitting alike (the lockstep check compares the ranks' batches)."""

from __future__ import annotations

import asyncio

import pytest

from lockstep.entrypoints.engine import launch_subprocesses
from lockstep.messages import TokenizedGenerateReq
from lockstep.sampling_params import SamplingParams
from lockstep.server_args import ServerArgs
from lockstep.testing.tiny_vision import data_url, make_tiny_vision_model, random_image

pytestmark = pytest.mark.server  # launches scheduler ranks as processes

PROMPTS = [("<start_of_image> what is it", [1]), ("a <start_of_image> b <start_of_image> c", [2, 3]),
           ("again <start_of_image>", [1])]


def _outputs(tp: int, dp: int = 1) -> list[list[int]]:
    launched = launch_subprocesses(ServerArgs(
        model_path=str(make_tiny_vision_model()), dtype="float32", tp_size=tp, dp_size=dp,
        max_total_tokens=4096, enable_lockstep_check=2))
    tm = launched.tokenizer_manager

    async def one(i: int, text: str, seeds: list[int]) -> list[int]:
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        req = TokenizedGenerateReq(f"r{i}", None, params, input_text=text,
                                   image_data=[data_url(random_image(s)) for s in seeds])
        async for out in tm.generate(req):
            last = out
        return last.output_ids

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, t, s) for i, (t, s) in enumerate(PROMPTS))))

    try:
        return asyncio.run(main())
    finally:
        launched.shutdown()


def test_tp2_and_dp2_equal_tp1_with_images():
    tp1 = _outputs(1)
    assert _outputs(2) == tp1
    assert _outputs(1, dp=2) == tp1  # the DP controller routes image requests to either replica

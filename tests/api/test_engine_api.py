"""The offline `lockstep.Engine` on a tiny model: generate, batch, stream, async, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

import lockstep
from lockstep.testing.live_server import alive_pids
from lockstep.testing.tiny_models import make_tiny_model

pytestmark = pytest.mark.server  # every test here runs an Engine

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "def add(a, b):"]


def test_generate_single(engine):
    out = engine.generate(PROMPTS[0], GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert len(out["output_ids"]) == 8
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert out["meta_info"]["prompt_tokens"] > 0
    by_ids = engine.generate(input_ids=engine.tokenizer_manager.tokenizer(PROMPTS[0]).input_ids,
                             sampling_params=GREEDY)
    assert by_ids["output_ids"] == out["output_ids"]


def test_generate_batch(engine):
    outs = engine.generate(PROMPTS, GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[0]["output_ids"] == engine.generate(PROMPTS[0], GREEDY)["output_ids"]
    per_prompt = engine.generate(PROMPTS, [GREEDY, {**GREEDY, "max_new_tokens": 3}])
    assert [len(o["output_ids"]) for o in per_prompt] == [8, 3]
    logprobs = engine.generate(PROMPTS[1], GREEDY, return_logprob=True, top_logprobs_num=2)
    assert len(logprobs["meta_info"]["output_token_logprobs"]) == 8


def test_generate_stream(engine):
    full = engine.generate(PROMPTS[1], GREEDY)
    chunks = list(engine.generate(PROMPTS[1], GREEDY, stream=True))
    assert len(chunks) >= 2
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    batch = list(engine.generate(PROMPTS, GREEDY, stream=True))
    assert {c["index"] for c in batch} == {0, 1}


def test_stream_stopped_early_aborts(engine):
    stream = engine.generate(PROMPTS[0], {"max_new_tokens": 3000, "ignore_eos": True},
                             stream=True)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 3
    while engine.get_server_info()["num_running_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.get_server_info()["num_running_requests"] == 0


def test_async_generate(engine):
    async def main():
        one = await engine.async_generate(PROMPTS[0], GREEDY)
        both = await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in PROMPTS))
        stream = await engine.async_generate(PROMPTS[1], GREEDY, stream=True)
        chunks = [c async for c in stream]
        return one, both, chunks

    one, both, chunks = asyncio.run(main())
    assert one["output_ids"] == both[0]["output_ids"] == engine.generate(PROMPTS[0], GREEDY)["output_ids"]
    assert chunks[-1]["output_ids"] == both[1]["output_ids"]


def test_bad_input_raises_value_error(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("x", {"temperature": -1})
    with pytest.raises(ValueError, match="context length"):
        engine.generate("x", {"max_new_tokens": 10**6})
    assert len(engine.generate("x", GREEDY)["output_ids"]) == 8  # still serving


def test_with_block_leaves_no_process():
    with lockstep.Engine(model_path=str(make_tiny_model("qwen2")), max_total_tokens=2048) as eng:
        pids = eng.child_pids
        assert len(pids) >= 2 and len(alive_pids(pids)) == len(pids)
        assert len(eng.generate("hello", GREEDY)["output_ids"]) == 8
    assert not alive_pids(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("hello", GREEDY)

"""Gemma 3 with images on lockstep's own layers against HF transformers' Gemma3ForConditionalGeneration
(the tiny random-weight model of lockstep.testing.tiny_vision): greedy tokens and logprobs with one
and several images, the same bits alone and in a batch, chunked or not; the encoder cache runs the
tower once per distinct image; image tokens share prefix-tree entries only when the image is the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.multimodal.images import ImageError
from lockstep.testing.image_oracle import NEW, prepare, req
from lockstep.testing.image_oracle import hf_greedy as oracle_greedy
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.tiny_vision import (
    data_url,
    hf_image_inputs,
    make_tiny_vision_model,
    random_image,
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_tiny_vision_model()


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_greedy(hf_model: Any, model_dir: Path, prompt: str, images: list[Any]) -> tuple[list[int], list[float]]:
    return oracle_greedy(hf_model, hf_image_inputs(model_dir, prompt, images))


CASES = [("<start_of_image> describe the cat", [0]),
         ("the first <start_of_image> and the second <start_of_image> differ how", [1, 2]),
         ("same twice <start_of_image><start_of_image> then text", [3, 3]),
         # past the sliding window (32 in the tiny model): an image row's window starts from its
         # own position, as HF's mask has it, not from its image's end
         (" ".join(["a long preamble before the picture"] * 8) + " <start_of_image> so", [4])]


@pytest.mark.parametrize("prompt,seeds", CASES)
def test_matches_hf_greedy_and_logprobs(model_dir, inputs, tok, hf_model, held, prompt, seeds):
    images = [random_image(s) for s in seeds]
    want_ids, want_lps = hf_greedy(hf_model, model_dir, prompt, images)
    p = prepare(inputs, tok, prompt, images, held)
    # the prompt lockstep builds is HF's processor's, but for the image tokens' hash-derived ids
    hf_ids = hf_image_inputs(model_dir, prompt, images)["input_ids"][0].tolist()
    assert [t if t < 515 else 513 for t in p.input_ids] == hf_ids
    sched = make_scheduler(str(model_dir))
    got = run_to_completion(sched, [req("a", p, return_logprob=True)])["a"]
    assert got.output_ids == want_ids
    assert got.logprobs == pytest.approx(want_lps, abs=2e-4)


def test_alone_equals_batched_and_chunked(model_dir, inputs, tok, held):
    prompt, other = CASES[1][0], "a text-only neighbour prompt with more words in it"
    p = prepare(inputs, tok, prompt, [random_image(1), random_image(2)], held)
    q = prepare(inputs, tok, CASES[0][0], [random_image(5)], held)
    alone = run_to_completion(make_scheduler(str(model_dir)), [req("a", p, return_logprob=True)])["a"]
    tok_ids = tok(other).input_ids
    batched = run_to_completion(make_scheduler(str(model_dir)), [
        greedy_req("t", tok_ids, NEW), req("q", q), req("a", p, return_logprob=True)])["a"]
    # chunks of 5 tokens: a chunk that would end inside an image takes the image whole
    chunked = run_to_completion(make_scheduler(str(model_dir), chunked_prefill_size=5),
                                [req("a", p, return_logprob=True)])["a"]
    assert alone.output_ids == batched.output_ids == chunked.output_ids
    assert alone.logprobs == batched.logprobs == chunked.logprobs  # bitwise


def test_encoder_cache_and_prefix_sharing_by_hash(model_dir, inputs, tok, held):
    prompt = "<start_of_image> describe the cat in a few words"
    same1 = prepare(inputs, tok, prompt, [random_image(7)], held)
    same2 = prepare(inputs, tok, prompt, [random_image(7)], held)
    other = prepare(inputs, tok, prompt, [random_image(8)], held)
    assert same1.images[0].digest == same2.images[0].digest != other.images[0].digest
    assert same1.input_ids == same2.input_ids != other.input_ids
    sched = make_scheduler(str(model_dir))
    stats = sched.worker.runner.model.encoder_cache.stats
    first = run_to_completion(sched, [req("a", same1)])["a"]
    assert (stats.runs, stats.hits) == (1, 0)
    again = run_to_completion(sched, [req("b", same2)])["b"]
    # the same image and prompt: the whole prompt but its last token from the prefix tree, and
    # the tower not run again (the prefix needed no image features at all)
    assert again.cached_tokens == len(same2.input_ids) - 1
    assert again.output_ids == first.output_ids
    assert stats.runs == 1
    diff = run_to_completion(sched, [req("c", other)])["c"]
    image_start = other.images[0].offset
    assert diff.cached_tokens == image_start  # shares the text before the image, not the image
    assert stats.runs == 2
    sched.tree.reset()  # the prefix gone, the features still cached
    run_to_completion(sched, [req("d", same2)])
    assert (stats.runs, stats.hits) == (2, 1)


def test_an_image_id_outside_its_own_span_is_refused(model_dir, inputs, tok, held):
    """A prompt may not carry an image's hash-derived id anywhere but in that image's span: its
    KV, computed without the image, would enter the prefix tree under the image's ids."""
    p = prepare(inputs, tok, "<start_of_image> describe", [random_image(9)], held)
    pad = p.input_ids[p.images[0].offset]
    sched = make_scheduler(str(model_dir))
    no_image = greedy_req("x", p.input_ids, 2)  # the ids, but not the image
    extra = req("y", p)
    extra.input_ids = [*p.input_ids[:1], pad, *p.input_ids[1:]]  # one more, outside the span
    res = run_to_completion(sched, [no_image, extra])
    for rid in ("x", "y"):
        assert res[rid].finish_reason.status_code == 400
        assert "outside the vocabulary" in res[rid].finish_reason.message
    with pytest.raises(ImageError, match="outside the vocabulary"):
        inputs.prepare([pad, *p.input_ids], [data_url(random_image(9))])

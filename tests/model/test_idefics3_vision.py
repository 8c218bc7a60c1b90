"""Idefics3 / SmolVLM with images on lockstep's own layers against HF transformers'
Idefics3ForConditionalGeneration (the tiny random-weight model of lockstep.testing.tiny_idefics3):
the prompt is HF's processor's (tiles, row/col tokens, the global view) but for the image tokens'
hash-derived ids; greedy tokens and logprobs with one image and with two of different tilings;
the same bits alone and in a batch, chunked or not; the tower's NaViT position ids are HF's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.multimodal.refs import is_pad_id
from lockstep.testing.image_oracle import NEW, prepare, req
from lockstep.testing.image_oracle import hf_greedy as oracle_greedy
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.tiny_idefics3 import (
    IMAGE_ID,
    TOKENS_PER_TILE,
    hf_idefics3_inputs,
    make_tiny_idefics3_model,
)
from lockstep.testing.tiny_vision import data_url, random_image


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_tiny_idefics3_model()


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_greedy(hf_model: Any, model_dir: Path, prompt: str, images: list[Any]) -> tuple[list[int], list[float]]:
    return oracle_greedy(hf_model, hf_idefics3_inputs(model_dir, prompt, images))


# 50x40 becomes 2x2 tiles + the global view; 24x60 (tall) 2 rows x 1 column + the global view
CASES = [("<image> describe the cat", [(0, 50, 40)]),
         ("the first <image> and the second <image> differ how", [(1, 50, 40), (2, 24, 60)])]


def images_of(specs: list[tuple[int, int, int]]) -> list[Any]:
    return [random_image(seed, w, h) for seed, w, h in specs]


@pytest.mark.parametrize("prompt,specs", CASES)
def test_matches_hf_greedy_and_logprobs(model_dir, inputs, tok, hf_model, held, prompt, specs):
    images = images_of(specs)
    want_ids, want_lps = hf_greedy(hf_model, model_dir, prompt, images)
    p = prepare(inputs, tok, prompt, images, held)
    # the prompt lockstep builds is HF's processor's, but for the image tokens' hash-derived ids
    hf_ids = hf_idefics3_inputs(model_dir, prompt, images)["input_ids"][0].tolist()
    assert [IMAGE_ID if is_pad_id(t) else t for t in p.input_ids] == hf_ids
    # every tile of an image carries that image's id; different images' ids differ
    pads = [sorted({t for t in p.input_ids[r.offset:r.end]}) for r in p.images]
    assert all(len(x) == 1 for x in pads) and len({x[0] for x in pads}) == len(images)
    assert all(r.num_tokens == TOKENS_PER_TILE and not r.bidirectional for r in p.images)
    sched = make_scheduler(str(model_dir))
    got = run_to_completion(sched, [req("a", p, return_logprob=True)])["a"]
    assert got.output_ids == want_ids
    assert got.logprobs == pytest.approx(want_lps, abs=2e-4)
    assert sched.worker.runner.model.encoder_cache.stats.runs == len(images)  # one run per image, all tiles


def test_alone_equals_batched_and_chunked(model_dir, inputs, tok, held):
    prompt, other = CASES[1][0], "a text-only neighbour prompt with more words in it"
    p = prepare(inputs, tok, prompt, images_of(CASES[1][1]), held)
    q = prepare(inputs, tok, CASES[0][0], [random_image(5)], held)
    alone = run_to_completion(make_scheduler(str(model_dir)), [req("a", p, return_logprob=True)])["a"]
    batched = run_to_completion(make_scheduler(str(model_dir)), [
        greedy_req("t", tok(other).input_ids, NEW), req("q", q), req("a", p, return_logprob=True)])["a"]
    # chunks of 7 tokens: a chunk that would end inside a tile's tokens takes the tile whole
    chunked = run_to_completion(make_scheduler(str(model_dir), chunked_prefill_size=7),
                                [req("a", p, return_logprob=True)])["a"]
    assert alone.output_ids == batched.output_ids == chunked.output_ids
    assert alone.logprobs == batched.logprobs == chunked.logprobs  # bitwise


def test_navit_position_ids_are_hfs():
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    from lockstep.models.idefics3 import navit_position_ids

    for side, rows, cols in ((32, 32, 32), (27, 27, 27), (8, 8, 8), (8, 5, 7), (26, 13, 26)):
        emb = Idefics3VisionEmbeddings(Idefics3VisionConfig(image_size=side * 2, patch_size=2,
                                                            hidden_size=4))
        with torch.no_grad():
            emb.patch_embedding.weight.zero_()
            emb.patch_embedding.bias.zero_()
            emb.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None])
        mask = torch.ones(1, rows, cols, dtype=torch.bool)
        hf = emb(torch.zeros(1, 3, rows * 2, cols * 2), mask)[0, :, 0].long()
        assert navit_position_ids(rows, cols, side).tolist() == hf.tolist()


def test_encoder_cache_and_prefix_sharing_by_hash(model_dir, inputs, tok, held):
    """The same image again: the prompt from the prefix tree, the tower not run again; another
    image of the same tiling shares the text and the first tile's row/col tokens before its first
    image token, not the image."""
    prompt = "<image> describe the cat in a few words"
    same1 = prepare(inputs, tok, prompt, [random_image(7)], held)
    same2 = prepare(inputs, tok, prompt, [random_image(7)], held)
    other = prepare(inputs, tok, prompt, [random_image(8)], held)
    assert same1.input_ids == same2.input_ids != other.input_ids
    sched = make_scheduler(str(model_dir))
    stats = sched.worker.runner.model.encoder_cache.stats
    first = run_to_completion(sched, [req("a", same1)])["a"]
    again = run_to_completion(sched, [req("b", same2)])["b"]
    assert again.cached_tokens == len(same2.input_ids) - 1 and again.output_ids == first.output_ids
    assert (stats.runs, stats.hits) == (1, 0)
    diff = run_to_completion(sched, [req("c", other)])["c"]
    assert diff.cached_tokens == other.images[0].offset and stats.runs == 2


def test_places_and_counts(inputs, tok, hf_model, model_dir):
    from lockstep.multimodal.images import ImageError

    url = data_url(random_image(3))
    with pytest.raises(ImageError, match="1 image places .* for 2 images"):
        inputs.prepare(tok("one <image> only").input_ids, [url, url])
    # ids already holding HF's expanded tiles are refused by name, not taken as many images
    expanded = hf_idefics3_inputs(model_dir, "x <image>", [random_image(3)])["input_ids"][0].tolist()
    with pytest.raises(ImageError, match=f"a run of {TOKENS_PER_TILE} image tokens"):
        inputs.prepare(expanded, [url])

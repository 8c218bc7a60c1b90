"""What the vision-model tests share (tests/model/test_*_vision.py): prompts with prepared images
as the front builds them, requests that carry them, and HF transformers' greedy tokens and
logprobs, the oracle every family is compared with."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lockstep.multimodal.images import ImageLimits
from lockstep.multimodal.processing import ImageInputs, PreparedImages, image_inputs_for
from lockstep.testing.inproc import greedy_req
from lockstep.testing.tiny_vision import data_url

NEW = 8  # greedy tokens each comparison generates


def front_inputs(model_dir: Path, tok: Any) -> ImageInputs:
    """The front's image handling, as the server builds it for this directory."""
    got = image_inputs_for(model_dir, json.loads((model_dir / "config.json").read_text()), tok,
                           ImageLimits())
    if got is None:
        raise ValueError(f"{model_dir} is not a model that reads images")
    return got


def held_segments() -> Iterator[list[Any]]:
    """Prepared images' shared-memory segments, unlinked when the generator ends (a fixture's body)."""
    segs: list[Any] = []
    yield segs
    for s in segs:
        s.close()
        s.unlink()


def prepare(inputs: ImageInputs, tok: Any, prompt: str, images: list[Any], held: list[Any]) -> PreparedImages:
    ids = tok(inputs.expand_text(prompt)).input_ids
    p = inputs.prepare(ids, [data_url(im) for im in images])
    held.extend(p.segments)
    return p


def req(rid: str, p: PreparedImages, **kw: Any) -> Any:
    r = greedy_req(rid, p.input_ids, NEW, **kw)
    r.images = p.images
    return r


def hf_greedy(hf_model: Any, inp: dict[str, Any]) -> tuple[list[int], list[float]]:
    """HF's NEW greedy tokens for processor inputs `inp`, and their logprobs."""
    out = hf_model.generate(**inp, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            min_new_tokens=NEW, output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, inp["input_ids"].shape[1]:].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]
    return ids, lps

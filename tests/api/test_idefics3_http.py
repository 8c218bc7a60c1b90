"""Images through a live server of the tiny Idefics3 / SmolVLM model (lockstep.testing.tiny_idefics3):
a chat image_url part (through SmolVLM's own chat template, which reads typed content parts) and
/generate image_data give HF's greedy tokens for the prompt HF's processor
builds (tiles, row/col tokens, the global view), and every image's shared memory is freed after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from lockstep.multimodal.shm import SEGMENT_PREFIX
from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_idefics3 import hf_idefics3_processor, make_tiny_idefics3_model
from lockstep.testing.tiny_vision import data_url, random_image

NEW = 6
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_tiny_idefics3_model()


@pytest.fixture(scope="module")
@marks("server")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = LiveServer("--model-path", str(model_dir), "--max-total-tokens", "4096",
                     log_dir=tmp_path_factory.mktemp("idefics3-server"), startup_timeout=180)
    yield srv
    srv.stop_cleanly()


def segments() -> set[str]:
    return {p.name for p in SHM.glob(f"{SEGMENT_PREFIX}*")} if SHM.is_dir() else set()


def hf_tokens(model_dir: Path, text: str, images: list[Any], add_special_tokens: bool
              ) -> tuple[int, list[int]]:
    """HF's prompt length and greedy tokens for `text` and its images."""
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    inp = hf_idefics3_processor(model_dir)(text=text, images=images, return_tensors="pt",
                                            add_special_tokens=add_special_tokens)
    out = model.generate(input_ids=inp["input_ids"], attention_mask=inp["attention_mask"],
                         pixel_values=inp["pixel_values"], pixel_attention_mask=inp["pixel_attention_mask"],
                         max_new_tokens=NEW, do_sample=False, eos_token_id=None, min_new_tokens=NEW)
    n = inp["input_ids"].shape[1]
    return n, out[0, n:].tolist()


def test_chat_and_generate_match_hf(server, model_dir):
    before = segments()
    cat, tall = random_image(41), random_image(42, 24, 60)
    r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(cat)}},
            {"type": "text", "text": "what is this?"}]}]})
    assert r.status_code == 200, r.text
    # SmolVLM's template reads typed parts and writes the image part as "<image>"; as HF renders
    # it for the processor (the text holds <|im_start|>: no more special tokens added)
    tok = hf_idefics3_processor(model_dir).tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>User:<image>what is this?<end_of_utterance>\nAssistant:"
    n, want = hf_tokens(model_dir, text, [cat], add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == n  # the same prompt, its image's tiles included
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)

    prompt = "two: <image> then <image> compared"
    g = requests.post(server.url + "/generate", timeout=120, json={
        "text": prompt, "image_data": [data_url(cat), data_url(tall)],
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})
    assert g.status_code == 200, g.text
    n, want = hf_tokens(model_dir, prompt, [cat, tall], add_special_tokens=True)
    assert g.json()["output_ids"] == want and g.json()["meta_info"]["prompt_tokens"] == n
    assert segments() == before  # every request's pixels freed once it ended

"""Images through a live server of the tiny Gemma 3 vision model: /generate image_data (one, a
list, bare base64) and chat image_url parts give HF's greedy tokens; hostile images (corrupt,
truncated, a decompression bomb, too large, too many, a wrong media type, a local path, a URL
without --allow-image-urls) are each a 400 naming the problem, the server serving on and no
shared-memory segment left behind; a text-only model refuses images by name."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import torch

from lockstep.multimodal.shm import SEGMENT_PREFIX
from lockstep.testing.live_server import API_KEY, LiveServer, sse_events
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_vision import (
    data_url,
    hf_image_inputs,
    make_tiny_vision_model,
    random_image,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def vision_dir() -> Path:
    return make_tiny_vision_model()


@pytest.fixture(scope="module")
@marks("server")
def server(vision_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = LiveServer("--model-path", str(vision_dir), "--max-total-tokens", "4096",
                     "--max-image-bytes", "200000", "--max-images-per-request", "3",
                     log_dir=tmp_path_factory.mktemp("vision-server"), startup_timeout=180)
    yield srv
    srv.stop_cleanly()


def segments() -> set[str]:
    return {p.name for p in SHM.glob(f"{SEGMENT_PREFIX}*")} if SHM.is_dir() else set()


def hf_tokens(vision_dir: Path, prompt: str, images: list[Any]) -> list[int]:
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(str(vision_dir), dtype=torch.float32).eval()
    inp = hf_image_inputs(vision_dir, prompt, images)
    out = model.generate(**inp, max_new_tokens=6, do_sample=False, eos_token_id=None, min_new_tokens=6)
    return out[0, inp["input_ids"].shape[1]:].tolist()


def test_generate_image_data_matches_hf(server, vision_dir):
    before = segments()
    prompt = "two pictures <start_of_image> and <start_of_image> compared"
    images = [random_image(11), random_image(12)]
    want = hf_tokens(vision_dir, prompt, images)
    r = requests.post(server.url + "/generate", timeout=120, json={
        "text": prompt, "image_data": [data_url(images[0]), data_url(images[1])],
        "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want
    one = requests.post(server.url + "/generate", timeout=120, json={
        "text": "<start_of_image> one", "sampling_params": GREEDY,
        "image_data": data_url(images[0]).split(",", 1)[1]})  # bare base64
    assert one.status_code == 200, one.text
    assert one.json()["output_ids"] == hf_tokens(vision_dir, "<start_of_image> one", images[:1])
    assert segments() == before  # every request's pixels freed once it ended


def test_chat_image_url_parts(server):
    body = {"max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look: "},
                                     {"type": "image_url", "image_url": {"url": data_url(random_image(1))}}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(random_image(2))}},
                                     {"type": "text", "text": "and this one?"}]}]}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 2 * 4  # both images' tokens are in the prompt


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height, with one tiny compressed row: a bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
            + chunk(b"IEND", b""))


def _b64url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _png_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    random_image(seed).save(buf, format="PNG")
    return buf.getvalue()


HOSTILE = [
    ("corrupt", lambda: _b64url(b"garbage" * 20), "not an image"),
    ("corrupt png", lambda: _b64url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), "corrupt or truncated"),
    ("truncated", lambda: _b64url(_png_bytes(3)[:200]), "corrupt or truncated"),
    ("bomb", lambda: _b64url(_png_header_only(100_000, 100_000)), "decompression bomb"),
    ("too big", lambda: _b64url(b"\x00" * 300_000), "--max-image-bytes"),
    ("media type", lambda: _b64url(_png_bytes(3), "text/plain"), "media type 'text/plain'"),
    ("not base64", lambda: "data:image/png;base64,@@@@", "not valid base64"),
    ("local path", lambda: "/etc/passwd", "local files never are"),
    ("url", lambda: "http://127.0.0.1:9/cat.png", "--allow-image-urls"),
]


@pytest.mark.parametrize("name,make,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_image_is_a_400(server, name, make, message):
    before = segments()
    r = requests.post(server.url + "/generate", timeout=60, json={
        "text": "<start_of_image> x", "image_data": make(), "sampling_params": GREEDY})
    assert r.status_code == 400, (name, r.text)
    assert message in r.text
    assert segments() == before
    ok = requests.post(server.url + "/generate", timeout=60, json={
        "text": "<start_of_image> fine", "image_data": data_url(random_image(4)), "sampling_params": GREEDY})
    assert ok.status_code == 200, ok.text  # the server serves on


def test_count_and_placement_errors(server):
    url = data_url(random_image(5))
    r = requests.post(server.url + "/generate", timeout=60, json={
        "text": "<start_of_image>" * 4, "image_data": [url] * 4, "sampling_params": GREEDY})
    assert r.status_code == 400 and "--max-images-per-request" in r.text
    r = requests.post(server.url + "/generate", timeout=60, json={
        "text": "no place for it", "image_data": url, "sampling_params": GREEDY})
    assert r.status_code == 400 and "image places" in r.text
    r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:text/html;base64,PGI+"}}]}]})
    assert r.status_code == 400 and "text/html" in r.text


def test_many_hostile_requests_leak_nothing(server):
    bads = [_b64url(_png_bytes(6)[:300]), _b64url(_png_header_only(60_000, 60_000)),
            _b64url(b"\x00" * 150_000), "data:text/plain;base64,aGk="]

    def send(n: int) -> None:
        for i in range(n):
            r = requests.post(server.url + "/generate", timeout=60, json={
                "text": "<start_of_image> x", "image_data": bads[i % len(bads)], "sampling_params": GREEDY})
            assert r.status_code == 400

    send(20)  # warm: the allocator's pools and the server's caches at their working size
    before, rss = segments(), psutil.Process(server.proc.pid).memory_info().rss
    send(100)
    assert segments() == before
    grown = psutil.Process(server.proc.pid).memory_info().rss - rss
    assert grown < 16 << 20, f"the front grew by {grown / 2**20:.1f} MiB over 100 refused images"
    assert server.alive()


def test_streaming_stop_strings_and_grammars_with_images(server, vision_dir):
    url = data_url(random_image(31))
    plain = requests.post(server.url + "/generate", timeout=60, json={
        "text": "<start_of_image> say", "image_data": url, "sampling_params": GREEDY}).json()
    r = requests.post(server.url + "/generate", timeout=60, stream=True, json={
        "text": "<start_of_image> say", "image_data": url, "sampling_params": GREEDY, "stream": True})
    events = sse_events(r)
    assert len(events) > 1 and events[-1]["output_ids"] == plain["output_ids"]
    stop = plain["text"][2:5]
    cut = requests.post(server.url + "/generate", timeout=60, json={
        "text": "<start_of_image> say", "image_data": url,
        "sampling_params": {**GREEDY, "stop": [stop]}}).json()
    assert stop not in cut["text"] and plain["text"].startswith(cut["text"])
    assert cut["meta_info"]["finish_reason"]["type"] == "stop"
    regex = requests.post(server.url + "/generate", timeout=60, json={
        "text": "<start_of_image> say", "image_data": url,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "regex": "(yes|no)"}}).json()
    assert regex["text"] in ("yes", "no")
    chat = requests.post(server.url + "/v1/chat/completions", timeout=60, stream=True, json={
        "max_tokens": 4, "temperature": 0, "stream": True, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]})
    assert chat.status_code == 200 and sse_events(chat)


def test_text_only_model_refuses_images(llama_server: LiveServer):
    h = AUTH
    r = requests.post(llama_server.url + "/generate", headers=h, timeout=60, json={
        "text": "<start_of_image> x", "image_data": data_url(random_image(1)), "sampling_params": GREEDY})
    assert r.status_code == 400 and "takes no images" in r.text
    r = requests.post(llama_server.url + "/v1/chat/completions", headers=h, timeout=60, json={
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(random_image(1))}}]}]})
    assert r.status_code == 400 and "takes no images" in r.text


def _metric(server: LiveServer, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_encoder_metric_counts_runs_and_hits(server):
    url = data_url(random_image(21))
    runs, hits = _metric(server, "lockstep:image_encoder_runs"), _metric(server, "lockstep:image_encoder_hits")
    outs = []
    # different text before the same image: no shared prefix covers it, the encoder cache does
    for text in ("first <start_of_image> tell", "second one <start_of_image> tell"):
        r = requests.post(server.url + "/generate", timeout=60, json={
            "text": text, "image_data": url, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        outs.append(r.json())
    assert _metric(server, "lockstep:image_encoder_runs") == runs + 1
    assert _metric(server, "lockstep:image_encoder_hits") == hits + 1

"""LoRA adapters through a live server: SGLang's surface (--lora-paths, lora_path on /generate,
model "base:adapter", /load_lora_adapter) and vLLM's (the adapter's name as model, /v1/models with
parent, /v1/load_lora_adapter), each output compared with HF transformers + PEFT; unknown
adapters and loads that do not fit are clear 4xx that disturb nothing."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import requests

from lockstep.testing.live_server import LiveServer
from lockstep.testing.lora_adapters import make_peft_adapter, peft_model
from lockstep.testing.oracle import greedy_matches, hf_greedy, load_hf_model
from lockstep.testing.tiny_models import tiny_prompts

pytestmark = pytest.mark.server
NEW = 6


def _generate(url: str, prompts: list[list[int]], lora=None) -> list[list[int]]:
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                      "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def test_adapters_served_loaded_and_unloaded_over_http(model_dir: Path, tmp_path: Path) -> None:
    a = make_peft_adapter(model_dir, tmp_path / "a", seed=21, rank=8)
    b = make_peft_adapter(model_dir, tmp_path / "b", seed=22, rank=8, targets=("q_proj", "v_proj", "down_proj"))
    c = make_peft_adapter(model_dir, tmp_path / "c", seed=23, rank=4, use_rslora=True)
    big = make_peft_adapter(model_dir, tmp_path / "big", seed=24, rank=16)
    prompts = tiny_prompts(model_dir, 3, seed=31)
    expect = {name: [e.output_ids for e in hf_greedy(model_dir, prompts, NEW, model=m)] for name, m in
              (("a", peft_model(model_dir, a)), ("b", peft_model(model_dir, b)),
               ("c", peft_model(model_dir, c)), (None, load_hf_model(model_dir)))}
    srv = LiveServer("--model-path", str(model_dir), "--max-total-tokens", "4096",
                     "--lora-paths", f"a={a}", f"b={b}", "--max-lora-rank", "8",
                     "--lora-target-modules", "all", "--max-loras-per-batch", "2",
                     log_dir=tmp_path, startup_timeout=180)
    try:
        url = srv.url
        # SGLang: one adapter per prompt, the base among them, in one batch
        mixed = _generate(url, prompts, ["a", None, "b"])
        assert mixed == [expect["a"][0], expect[None][1], expect["b"][2]]
        assert _generate(url, prompts, "b") == expect["b"]
        # unknown adapter: a 404 naming it
        r = requests.post(url + "/generate", json={"text": "hi", "lora_path": "nope"}, timeout=30)
        assert r.status_code == 404 and "'nope'" in r.text
        # OpenAI: "base:adapter" and the adapter's own name; /v1/models lists adapters with parent
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        base = client.models.list().data[0].id
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {base, "a", "b"}
        assert cards["a"].parent == base and cards["a"].root == str(a)
        for model in (f"{base}:a", "a"):
            out = client.completions.create(model=model, prompt=prompts[0], max_tokens=NEW,
                                            temperature=0, extra_body={"ignore_eos": True})
            by_path = client.completions.create(model=base, prompt=prompts[0], max_tokens=NEW, temperature=0,
                                                extra_body={"ignore_eos": True, "lora_path": "a"})
            assert out.choices[0].text == by_path.choices[0].text
            assert (out.model, by_path.model) == (model, base)  # the adapter's spelling answers back
        with pytest.raises(openai.NotFoundError, match="nope"):
            client.completions.create(model=f"{base}:nope", prompt="x", max_tokens=2)
        # SGLang's load route: a third adapter at run time, served at once
        r = requests.post(url + "/load_lora_adapter", json={"lora_name": "c", "lora_path": str(c)})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert set(r.json()["loaded_adapters"]) == {"a", "b", "c"}
        three = _generate(url, prompts, ["c", "a", "b"])  # three adapters, two slots: some wait
        assert greedy_matches(three[0], hf_greedy(model_dir, prompts[:1], NEW, model=peft_model(model_dir, c))[0])
        assert three[1:] == [expect["a"][1], expect["b"][2]]
        # beyond --max-lora-rank: a 400 naming why; what is loaded serves as before
        r = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
        assert r.status_code == 400 and "--max-lora-rank 8" in r.json()["error"]["message"]
        r = requests.post(url + "/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
        assert r.status_code == 400 and not r.json()["success"] and "rank 16" in r.json()["error_message"]
        assert _generate(url, prompts, "a") == expect["a"]
        # vLLM's unload route; then the name is unknown again
        r = requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 200 and "removed" in r.text
        r = requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 404 and "'c'" in r.text
        assert "c" not in {m.id for m in client.models.list().data}
        r = requests.post(url + "/generate", json={"text": "hi", "lora_path": "c"}, timeout=30)
        assert r.status_code == 404
        r = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(c)})
        assert r.status_code == 200 and "added" in r.text
        assert srv.alive()
    finally:
        srv.stop_cleanly()

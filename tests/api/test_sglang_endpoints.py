"""SGLang 0.5's info, tokenizer and metrics surface on a live tiny-model server: /server_info and
/model_info (and their /get_ names) with the model's resolved identity, /tokenize and
/detokenize (also under /v1/) against the tokenizer's own output, and Prometheus figures under
SGLang's names and label sets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks

SERVED = "tiny-llama"
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
@marks("server")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    srv = LiveServer("--model-path", str(model_dir), "--served-model-name", SERVED,
                     "--max-total-tokens", "8192", "--log-level", "warning",
                     log_dir=tmp_path_factory.mktemp("sglang-endpoints"), startup_timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


def post(server: LiveServer, path: str, body: Any) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=60)


def test_server_and_model_info(server, model_dir):
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(server.url + path, timeout=30).json()
        assert info["model_path"] == str(model_dir) and info["served_model_name"] == SERVED
        assert info["tokenizer_path"] == str(model_dir)
        assert info["tp_size"] == 1 and info["dp_size"] == 1 and info["version"]
        assert info["max_total_num_tokens"] == 8192
    for path in ("/model_info", "/get_model_info"):
        model = requests.get(server.url + path, timeout=30).json()
        assert model["model_path"] == str(model_dir) and model["served_model_name"] == SERVED
        assert model["tokenizer_path"] == str(model_dir) and model["is_generation"] is True
        assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
    assert [m["id"] for m in requests.get(server.url + "/v1/models").json()["data"]] == [SERVED]


@pytest.mark.real_model
def test_packaged_model_identity(real_server):
    """--model-path gemma-3-270m (a packaged model's short name): its GGUF is the model path and
    the short name the served name (they were null once, and SGLang's router registered the server
    as model "unknown"). The default model's: tests/model/test_default_model.py."""
    real = real_server
    info = requests.get(real.url + "/server_info", timeout=30).json()
    assert info["model_path"].endswith(".gguf") and Path(info["model_path"]).is_file()
    assert info["served_model_name"] == "gemma-3-270m"
    assert (Path(info["tokenizer_path"]) / "tokenizer.json").is_file()
    model = requests.get(real.url + "/model_info", timeout=30).json()
    assert model["model_type"] == "gemma3_text"


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_matches_the_tokenizer(server, tok, prefix):
    text = "The quick brown fox jumps over the lazy dog"
    r = post(server, prefix + "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    ids = tok(text).input_ids
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 4096}
    many = post(server, prefix + "/tokenize", {"model": SERVED, "prompt": [text, "hello"],
                                               "add_special_tokens": False}).json()
    plain = [tok(t, add_special_tokens=False).input_ids for t in (text, "hello")]
    assert many["tokens"] == plain and many["count"] == [len(p) for p in plain]
    assert plain[0] != ids  # the BOS token is the difference

    back = post(server, prefix + "/detokenize", {"tokens": ids}).json()
    assert back == {"text": tok.decode(ids, skip_special_tokens=True)} and back["text"] == text
    kept = post(server, prefix + "/detokenize",
                {"tokens": [ids, plain[1]], "skip_special_tokens": False}).json()
    assert kept == {"text": [tok.decode(ids), tok.decode(plain[1])]}


def test_tokenize_messages_is_the_chat_prompt(server):
    """Chat messages tokenize to exactly the prompt a chat completion sends to the model."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens == len(r.json()["tokens"])
    # Without the assistant turn's opening the template writes fewer tokens, and they are a
    # prefix of the chat prompt's.
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < r.json()["count"]
    assert r.json()["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/tokenize", {}, 400, "exactly one of prompt or messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
     "exactly one of prompt or messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt: must be a string"),
    ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools: applies only with messages"),
    ("/tokenize", {"prompt": "x", "colour": 1}, 400, "colour: unknown field"),
    ("/v1/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "does not exist"),
    ("/detokenize", {}, 400, "tokens: is required"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens: must be a list of token ids"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens[1]: must be >= 0"),
    ("/v1/detokenize", {"tokens": [1, 99999]}, 400, "token id 99999 is outside the vocabulary"),
    ("/detokenize", {"tokens": [[1], [2, 512]]}, 400, "tokens[1]: token id 512 is outside"),
])
def test_tokenize_bad_input(server, path, body, status, needle):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"], r.text
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def _samples(server: LiveServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = requests.get(server.url + "/metrics", timeout=30).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if labels.items() <= lab.items())


def test_metrics_under_sglang_names_and_labels(server):
    before = _samples(server)
    prompt = "Once upon a time, in a land far away, " * 4
    assert post(server, "/generate", {"text": prompt, "sampling_params": GREEDY}).ok
    with requests.post(server.url + "/generate", stream=True, timeout=60, json={
            "text": prompt, "sampling_params": GREEDY, "stream": True}) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    after = _samples(server)

    def grew(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    base = {"model_name": SERVED, "engine_type": "unified"}
    for streaming in ("false", "true"):
        s = {**base, "is_streaming": streaming}
        assert grew("sglang:num_requests_total", **s) == 1
        assert grew("sglang:generation_tokens_total", **s) == 12
        assert grew("sglang:prompt_tokens_total", **s) > 0
        assert grew("sglang:time_to_first_token_seconds_count", **s) == 1
        assert grew("sglang:e2e_request_latency_seconds_count", **s) == 1
        assert grew("sglang:request_time_per_output_token_seconds_count", **s) == 1
    # 11 gaps each (fewer if a request's first output carried two tokens)
    assert 20 <= grew("sglang:inter_token_latency_seconds_count", **base) <= 22
    # the second request found the first one's prompt in the prefix cache
    assert grew("sglang:cached_tokens_total", **base, cache_source="device") > 0
    assert grew("lockstep:num_requests_total", **base, finish_reason="length") == 2
    ranks = {**base, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    gauges = {name: _total(after, name, **ranks) for name in (
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
        "sglang:cache_hit_rate", "sglang:max_total_num_tokens", "sglang:context_len")}
    assert gauges["sglang:num_running_reqs"] == gauges["sglang:num_queue_reqs"] == 0
    assert gauges["sglang:token_usage"] == 0 and 0 < gauges["sglang:cache_hit_rate"] < 1
    assert gauges["sglang:max_total_num_tokens"] == 8192
    assert gauges["sglang:context_len"] == 4096
    assert not [n for n in after if n.startswith("lockstep:") and n != "lockstep:num_requests_total"]

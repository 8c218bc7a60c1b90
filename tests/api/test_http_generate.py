"""SGLang's native /generate and the server's other routes, against a live `lockstep.launch_server`
process: the session's tiny-model server behind --api-key (tests/conftest.py), and the real default
model for CJK/emoji streaming."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from transformers import AutoTokenizer

from lockstep.testing.live_server import API_KEY, LiveServer, sse_events

AUTH = {"Authorization": f"Bearer {API_KEY}"}


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def server(llama_server: LiveServer) -> LiveServer:
    return llama_server


@pytest.fixture(scope="module")
def http(server: LiveServer) -> requests.Session:
    s = requests.Session()
    s.headers.update(AUTH)
    return s


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


def generate(http: requests.Session, server: LiveServer, **body: Any) -> Any:
    r = http.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time, in a land far away"]


# ---------------------------------------------------------------------------------------------
# /generate


def test_generate_single(http, server, tok):
    out = generate(http, server, text=PROMPTS[0], sampling_params=GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 12 == meta["completion_tokens"]
    assert meta["prompt_tokens"] == len(tok(PROMPTS[0]).input_ids)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["id"] and meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)


def test_generate_batch_matches_singles(http, server):
    batch = generate(http, server, text=PROMPTS, sampling_params=GREEDY)
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, out in zip(PROMPTS, batch):
        single = generate(http, server, text=prompt, sampling_params=GREEDY)
        assert out["output_ids"] == single["output_ids"]
    # n > 1 fans out too: greedy samples are identical
    many = generate(http, server, text=PROMPTS[1], sampling_params={**GREEDY, "n": 2})
    assert len(many) == 2 and many[0]["output_ids"] == many[1]["output_ids"]


def test_generate_input_ids(http, server, tok):
    ids = tok(PROMPTS[2]).input_ids
    by_ids = generate(http, server, input_ids=ids, sampling_params=GREEDY)
    by_text = generate(http, server, text=PROMPTS[2], sampling_params=GREEDY)
    assert by_ids["output_ids"] == by_text["output_ids"]
    batch = generate(http, server, input_ids=[ids, tok(PROMPTS[0]).input_ids],
                     sampling_params=GREEDY)
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [len(ids), len(tok(PROMPTS[0]).input_ids)]


def test_stream_equals_non_stream(http, server):
    body = {"text": PROMPTS[1], "sampling_params": {**GREEDY, "max_new_tokens": 16}}
    plain = generate(http, server, **body)
    with http.post(server.url + "/generate", json={**body, "stream": True}, stream=True,
                   timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert len(events) >= 2
    # SGLang's default: every event carries everything so far.
    for prev, cur in zip(events, events[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert events[-1]["text"] == plain["text"]
    assert events[-1]["output_ids"] == plain["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_stream_batch_carries_index(http, server):
    body = {"text": PROMPTS[:2], "sampling_params": {**GREEDY, "max_new_tokens": 4},
            "stream": True}
    with http.post(server.url + "/generate", json=body, stream=True, timeout=120) as r:
        events = sse_events(r)
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"]}
    assert set(finals) == {0, 1}
    assert all(len(f["output_ids"]) == 4 for f in finals.values())


def _clean_stop(text: str) -> str | None:
    """A short ASCII substring of `text` to use as a stop string (not at its very start)."""
    for i in range(2, len(text) - 2):
        s = text[i:i + 2]
        if s.isascii() and s.strip() and s.isprintable():
            return s
    return None


def test_stop_strings_and_stop_token_ids(http, server):
    for prompt in PROMPTS:
        full = generate(http, server, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 24})
        stop = _clean_stop(full["text"])
        if stop is not None:
            break
    assert stop is not None, "no usable stop string in the greedy outputs"
    cut = generate(http, server, text=prompt,
                   sampling_params={**GREEDY, "max_new_tokens": 24, "stop": [stop, "\x00never"]})
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = generate(http, server, text=prompt,
                    sampling_params={**GREEDY, "max_new_tokens": 24, "stop": stop,
                                     "no_stop_trim": True})
    assert kept["text"].endswith(stop) and stop not in kept["text"][: -len(stop)]
    stop_id = full["output_ids"][4]
    by_id = generate(http, server, text=prompt,
                     sampling_params={**GREEDY, "max_new_tokens": 24, "stop_token_ids": [stop_id]})
    first = full["output_ids"].index(stop_id)
    assert by_id["output_ids"] == full["output_ids"][: first + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_logprobs(http, server):
    out = generate(http, server, text=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 5},
                   return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True)
    meta = out["meta_info"]
    lps, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(lps) == len(tops) == 5
    assert [tid for _lp, tid, _t in lps] == out["output_ids"]
    for (lp, tid, text), top in zip(lps, tops):
        assert lp <= 0 and isinstance(text, str)
        assert len(top) == 3
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-4)  # greedy = top-1
        assert top[0][0] >= top[1][0] >= top[2][0]
    assert meta["input_token_logprobs"] == []  # not asked for (logprob_start_len = -1)


def test_prompt_logprobs(http, server, tok):
    ids = tok(PROMPTS[2]).input_ids
    out = generate(http, server, input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 2},
                   return_logprob=True, logprob_start_len=0)
    ins = out["meta_info"]["input_token_logprobs"]
    assert [tid for _lp, tid, _t in ins] == ids
    assert ins[0][0] is None and all(lp <= 0 for lp, _tid, _t in ins[1:])
    later = generate(http, server, input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 2},
                     return_logprob=True, logprob_start_len=3, top_logprobs_num=2)
    ins3 = later["meta_info"]["input_token_logprobs"]
    assert [tid for _lp, tid, _t in ins3] == ids[3:]
    for a, b in zip(ins[4:], ins3[1:]):  # same positions, same logprobs (as SGLang's select needs)
        assert a[0] == pytest.approx(b[0], abs=1e-4)


def test_cached_tokens_on_repeated_long_prompt(http, server, tok):
    prompt = " ".join(f"item {i} is a {['cat', 'dog', 'bird'][i % 3]}." for i in range(80))
    n_prompt = len(tok(prompt).input_ids)
    assert n_prompt > 300
    first = generate(http, server, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})
    again = generate(http, server, text=prompt, sampling_params={**GREEDY, "max_new_tokens": 2})
    assert again["meta_info"]["cached_tokens"] > 0.9 * n_prompt
    assert again["output_ids"] == first["output_ids"]


def test_logit_bias_leaves_batch_neighbours_unchanged(http, server, tok):
    """A biased request in one batch with unbiased ones: theirs keep their ids and logprobs."""
    target = tok(" zebra", add_special_tokens=False).input_ids[-1]
    body = {"text": PROMPTS, "return_logprob": True}
    biased_sp = {**GREEDY, "logit_bias": {str(target): 100.0}}
    runs = []
    for params in (GREEDY, [GREEDY, biased_sp, GREEDY]):
        # From an empty prefix cache both times: a cached prefix may move a logprob by an ulp.
        assert http.post(server.url + "/flush_cache", timeout=60).status_code == 200
        runs.append(generate(http, server, **body, sampling_params=params))
    plain, mixed = runs
    for i in (0, 2):
        assert mixed[i]["output_ids"] == plain[i]["output_ids"]
        # Bit for bit in the sampler (test_sampler); here the three requests may be admitted in
        # different steps in the two runs, and a prefill's rounding on this path can follow its
        # batch (seen: 1e-6 on the first token), so the logprobs are compared to 1e-4.
        got, want = (r[i]["meta_info"]["output_token_logprobs"] for r in (mixed, plain))
        assert [t[1] for t in got] == [t[1] for t in want]
        assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(got, want))
    assert set(mixed[1]["output_ids"]) == {target} != set(plain[1]["output_ids"])
    # OpenAI's spelling: the same bias through /v1/completions.
    r = http.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "logit_bias": {str(target): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([target] * 3)


def test_usage_reports_cached_prompt_tokens(http, server, tok):
    prompt = " ".join(f"row {i} holds a {['fig', 'pear', 'plum'][i % 3]}." for i in range(80))
    n_prompt = len(tok(prompt).input_ids)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    first = http.post(server.url + "/v1/completions", json=body, timeout=120).json()["usage"]
    again = http.post(server.url + "/v1/completions", json=body, timeout=120).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] == n_prompt
    assert first["prompt_tokens_details"]["cached_tokens"] < 0.5 * n_prompt
    assert again["prompt_tokens_details"]["cached_tokens"] > 0.9 * n_prompt
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    http.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
    usage = http.post(server.url + "/v1/chat/completions", json=chat, timeout=120).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0.9 * usage["prompt_tokens"]


def test_sglang_router_requests_are_served(http, server):
    """sglang-router sends every SGLang 0.5 field it knows, at its default: all are accepted."""
    gen = generate(http, server, text=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 2},
                   model=None, log_metrics=True, return_hidden_states=False, background=False,
                   no_logs=False, return_bytes=False, return_entropy=False,
                   return_flat_raw_top_logprobs=False, return_flat_raw_top_logprobs_b64=False)
    assert len(gen["output_ids"]) == 2
    for path, body in (
            ("/v1/completions", {"prompt": "a", "max_tokens": 2, "return_hidden_states": False}),
            ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                "continue_final_message": False, "separate_reasoning": True,
                "stream_reasoning": True, "return_hidden_states": False})):
        r = http.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------
# Disconnects


def _running(http, server) -> int:
    return http.get(server.url + "/get_server_info", timeout=10).json()["num_running_requests"]


def _wait_idle(http, server, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if _running(http, server) == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"requests still running {timeout} s after the client left")


def test_stream_disconnect_aborts_request(http, server):
    body = json.dumps({"text": PROMPTS[0], "stream": True,
                       "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True,
                                           "temperature": 0}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)
    received = b""
    while received.count(b"data: ") < 3:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert b"200 OK" in received.split(b"\r\n")[0]
    assert _running(http, server) == 1
    sock.close()
    took = _wait_idle(http, server, timeout=3.0)
    assert took < 3.0
    # A new request still works, and the idle integrity check found no leaked KV.
    assert len(generate(http, server, text=PROMPTS[1], sampling_params=GREEDY)["output_ids"]) == 12
    time.sleep(1.0)
    assert "KV leak" not in server.log_text()
    assert server.alive()


def test_non_stream_disconnect_aborts_request(http, server):
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with pytest.raises(requests.exceptions.ReadTimeout):
        http.post(server.url + "/generate", json=body, timeout=1.0)
    _wait_idle(http, server, timeout=3.0)
    assert len(generate(http, server, text=PROMPTS[1], sampling_params=GREEDY)["output_ids"]) == 12


# ---------------------------------------------------------------------------------------------
# Other routes


def test_api_key(server, http):
    url = server.url + "/generate"
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    missing = requests.post(url, json=body, timeout=30)
    assert missing.status_code == 401
    assert "API key" in missing.json()["error"]["message"]
    wrong = requests.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    assert requests.post(url, json=body, headers=AUTH, timeout=30).status_code == 200
    for path in ("/get_server_info", "/v1/models", "/metrics", "/health_generate"):
        assert requests.get(server.url + path, timeout=30).status_code == 401, path
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


def test_info_routes(http, server, model_dir):
    info = http.get(server.url + "/get_server_info", timeout=30).json()
    assert info["max_total_num_tokens"] == 8192 and info["version"]
    assert info["model_path"] == str(model_dir) and info["api_key"] != API_KEY
    model = http.get(server.url + "/get_model_info", timeout=30).json()
    assert model["model_path"] == str(model_dir) and model["is_generation"] is True
    assert http.get(server.url + "/health_generate", timeout=60).status_code == 200
    models = http.get(server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [str(model_dir)]


def test_flush_cache_and_abort_route(http, server):
    _wait_idle(http, server, timeout=10)
    r = http.post(server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    r = http.post(server.url + "/abort_request", json={"rid": "no-such-request"}, timeout=30)
    assert r.status_code == 200
    # Abort a running request by rid: it finishes with an abort finish reason.
    body = {"text": PROMPTS[0], "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with http.post(server.url + "/generate", json=body, stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        assert http.post(server.url + "/abort_request", json={"rid": "abort-me"},
                         timeout=30).status_code == 200
        events = [json.loads(line[6:]) for line in lines
                  if line.startswith(b"data: ") and line != b"data: [DONE]"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    _wait_idle(http, server, timeout=3.0)


# ---------------------------------------------------------------------------------------------
# Bad input: every case a 4xx with a message that says what is wrong


def _case(path: str, body: Any, status: int, needle: str, method: str = "POST",
          raw: bytes | None = None) -> tuple:
    return (method, path, body, raw, status, needle)


SP = "sampling_params"
BAD_INPUTS = [
    _case("/generate", None, 400, "not valid JSON", raw=b'{"text": '),
    _case("/generate", None, 400, "UTF-8", raw=b'{"text": "\xff\xfe"}'),
    _case("/generate", None, 400, "empty", raw=b""),
    _case("/generate", None, 400, "surrogate", raw=b'{"text": "\\ud800"}'),
    _case("/generate", None, 400, "not valid JSON", raw=b'{"text": "a", ' + SP.encode() + b': {"temperature": NaN}}'),
    _case("/generate", [1, 2], 400, "must be an object"),
    _case("/generate", {}, 400, "exactly one of text or input_ids"),
    _case("/generate", {"text": "a", "input_ids": [1]}, 400, "exactly one of text or input_ids"),
    _case("/generate", {"text": 5}, 400, "text"),
    _case("/generate", {"text": "a", "foo": 1}, 400, "foo"),
    _case("/generate", {"text": "a", SP: {"temperature": -1}}, 400, "temperature"),
    _case("/generate", {"text": "a", SP: {"temperature": 1e400}}, 400, "not valid JSON"),
    _case("/generate", {"text": "a", SP: {"top_p": 0}}, 400, "top_p"),
    _case("/generate", {"text": "a", SP: {"top_p": 1.5}}, 400, "top_p"),
    _case("/generate", {"text": "a", SP: {"top_k": 0}}, 400, "top_k"),
    _case("/generate", {"text": "a", SP: {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    _case("/generate", {"text": "a", SP: {"max_new_tokens": "ten"}}, 400, "max_new_tokens"),
    _case("/generate", {"text": "a", SP: {"max_new_tokens": 100000}}, 400, "context length"),
    _case("/generate", {"text": "a", SP: {"min_new_tokens": 9, "max_new_tokens": 3}}, 400, "min_new_tokens"),
    _case("/generate", {"text": "a", SP: {"frequency_penalty": 5}}, 400, "frequency_penalty"),
    _case("/generate", {"text": "a", SP: {"stop": 5}}, 400, "stop"),
    _case("/generate", {"text": "a", SP: {"stop": [str(i) for i in range(40)]}}, 400, "stop"),
    _case("/generate", {"text": "a", SP: {"n": 1000}}, 400, "n"),
    _case("/generate", {"text": "a", SP: {"seed": "x"}}, 400, "seed"),
    _case("/generate", {"text": "a", SP: {"bogus": 1}}, 400, "bogus"),
    _case("/generate", {"input_ids": [10 ** 6]}, 400, "vocabulary"),
    _case("/generate", {"input_ids": [-1]}, 400, "input_ids"),
    _case("/generate", {"input_ids": []}, 400, "input_ids"),
    _case("/generate", {"text": []}, 400, "text"),
    _case("/generate", {"text": "word " * 5000}, 400, "context length"),
    _case("/generate", {"text": ["a", "b"], SP: [{}, {}, {}]}, 400, "sampling_params"),
    _case("/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, 400, "rid"),
    _case("/generate", {"text": "a", "top_logprobs_num": 2}, 400, "top_logprobs_num"),
    _case("/generate", {"text": "a", "logprob_start_len": -5}, 400, "logprob_start_len"),
    _case("/generate", {"text": "a", "stream": "yes"}, 400, "stream"),
    _case("/generate", {"text": "a", "return_hidden_states": True}, 400,
          "return_hidden_states: true is not supported by this server"),
    _case("/generate", {"text": "a", "return_flat_raw_top_logprobs_b64": True}, 400,
          "return_flat_raw_top_logprobs_b64: true is not supported by this server"),
    _case("/generate", {"text": "a", SP: {"logit_bias": {"999999": 1}}}, 400,
          "logit_bias: token id 999999 is outside the vocabulary"),
    _case("/v1/completions", {"prompt": "a", "logit_bias": {"1": 500}}, 400, "logit_bias.1"),
    _case("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                   "continue_final_message": True}, 400, "continue_final_message"),
    _case("/v1/completions", {"model": "nope", "prompt": "a"}, 404, "nope"),
    _case("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    _case("/v1/completions", {"prompt": "a", "logprobs": 10}, 400, "logprobs"),
    _case("/v1/completions", {"prompt": "a", "max_tokens": 10 ** 6}, 400, "context length"),
    _case("/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    _case("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    _case("/v1/chat/completions", {"messages": []}, 400, "messages"),
    _case("/v1/chat/completions", {"messages": [{"role": "robot", "content": "a"}]}, 400, "role"),
    _case("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "takes no images"),
    _case("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                   "tools": [{"type": "function"}]}, 400, "tool"),
    _case("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "a"}]}, 404, "gpt-4"),
    _case("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                   "response_format": {"type": "xml"}}, 400, "response_format"),
    _case("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuchtype"}}}},
        400, "nosuchtype"),
    _case("/abort_request", {}, 400, "rid"),
    _case("/no/such/route", None, 404, "no route", method="GET"),
    _case("/generate", None, 405, "not allowed", method="DELETE"),
]


def _send(server: LiveServer, case: tuple) -> tuple[int, dict]:
    method, path, body, raw, _status, _needle = case
    headers = {**AUTH, "Content-Type": "application/json"}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    r = requests.request(method, server.url + path, data=data, headers=headers, timeout=60)
    return r.status_code, r.json()


def test_bad_input_matrix(server, http):
    assert len(BAD_INPUTS) >= 25
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(lambda c: _send(server, c), BAD_INPUTS))
    problems = []
    for case, (status, body) in zip(BAD_INPUTS, results):
        _method, path, req, raw, want, needle = case
        err = body.get("error") if isinstance(body, dict) else None
        message = err.get("message", "") if isinstance(err, dict) else ""
        if status != want or needle not in message or err.get("code") != want:
            problems.append(f"{path} {req if raw is None else raw[:40]!r}: {status} {body}")
    assert not problems, "\n".join(problems)
    assert server.alive()
    out = generate(http, server, text=PROMPTS, sampling_params=GREEDY)
    assert [len(o["output_ids"]) for o in out] == [12, 12, 12]
    _wait_idle(http, server, timeout=5)
    assert "KV leak" not in server.log_text()
    assert "Traceback" not in server.log_text(), server.log_tail()


def test_body_too_large(server):
    big = b'{"text": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    r = requests.post(server.url + "/generate", data=big, headers=AUTH, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert server.alive()


def test_startup_log_and_children(server):
    assert "serving on " + server.url in server.log_text()
    assert len(server.child_pids) >= 2  # scheduler + detokenizer


# ---------------------------------------------------------------------------------------------
# The real model: multi-byte characters in a stream


@pytest.mark.real_model
def test_stream_cjk_and_emoji_never_broken(real_server):
    prompt = ("Repeat exactly: 春天来了🌸 我爱你😀 ☕️🦩\n"
              "Repeat exactly: 春天来了🌸 我爱你😀 ☕️🦩\nRepeat exactly:")
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    plain = requests.post(real_server.url + "/generate", json=body, timeout=300).json()
    with requests.post(real_server.url + "/generate", json={**body, "stream": True},
                       stream=True, timeout=300) as r:
        events = sse_events(r)
    for e in events:
        assert "\ufffd" not in e["text"], e["text"]
    final = events[-1]["text"]
    assert final == plain["text"]
    assert any(ord(c) > 0x3000 for c in final), final  # CJK or emoji really came through

"""SGLang's own router (`sglang-router` from PyPI, unchanged) in front of two live lockstep
servers on a tiny model: it registers them under their served model name, and /generate, both
OpenAI routes, streaming, spreading over both workers and failover when one is killed all work.

sglang-router==0.3.2 is installed with --no-deps into a venv of its own (testing.client_venv,
reused by later runs) that sees this interpreter's site-packages for its few dependencies
(fastapi, uvicorn, aiohttp, orjson, setproctitle), so nothing is installed into the project's
environment. The test skips, saying why, only when pip cannot reach the package index."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import requests

from lockstep.testing.client_venv import PackageIndexUnreachable, client_venv
from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks
from lockstep.utils.process import die_with_parent, free_port

ROUTER = "sglang-router==0.3.2"
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def router_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        python = client_venv(tmp_path_factory.getbasetemp().parent, [ROUTER], no_deps=True,
                             share_site=True)
    except PackageIndexUnreachable as e:
        pytest.skip(str(e))
    check = subprocess.run([python, "-m", "sglang_router.launch_router", "--help"],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    return python


@pytest.fixture(scope="module")
@marks("server")
def workers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LiveServer]:
    logs = tmp_path_factory.mktemp("sglang-router-workers")
    servers = [LiveServer("--model-path", str(model_dir), "--max-total-tokens", "8192",
                          "--log-level", "warning", log_dir=logs, wait=False) for _ in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


class Router:
    def __init__(self, python: Path, urls: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(self.port), "--policy", "round_robin", "--log-level", "warn",
             "--worker-urls", *urls],
            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def log_tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def models(self) -> list[str]:
        return [m["id"] for m in requests.get(self.url + "/v1/models", timeout=10).json()["data"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
@marks("server")
def router(router_python: Path, workers: list[LiveServer],
           tmp_path_factory: pytest.TempPathFactory) -> Router:
    r = Router(router_python, [w.url for w in workers],
               tmp_path_factory.mktemp("sglang-router") / "router.log")
    try:
        deadline = time.monotonic() + 120
        while True:  # serving once both workers are registered under a model
            assert r.proc.poll() is None, r.log_tail()
            try:
                workers_in = requests.get(r.url + "/workers", timeout=5).json()
                if len(workers_in.get("workers", [])) == 2 and r.models():
                    break
            except (requests.RequestException, ValueError):
                pass
            assert time.monotonic() < deadline, r.log_tail()
            time.sleep(0.5)
        yield r
    finally:
        r.stop()


def _requests_served(url: str) -> float:
    """sglang:num_requests_total summed over its label sets (the name SGLang's dashboards read)."""
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total{"))


def _sse(resp: requests.Response) -> list[Any]:
    events = [line[len(b"data: "):] for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_router_registers_the_served_model(router, workers, model_dir):
    """The router reads /server_info and /model_info: the workers' model is their served name,
    not "unknown", and the router's /v1/models lists it."""
    assert router.models() == [str(model_dir)]
    info = requests.get(workers[0].url + "/server_info", timeout=10).json()
    assert info["served_model_name"] == info["model_path"] == str(model_dir)
    model = requests.get(workers[0].url + "/model_info", timeout=10).json()
    assert model["tokenizer_path"] == str(model_dir) and model["model_type"] == "llama"
    assert model["architectures"] == ["LlamaForCausalLM"]


def test_generate_and_openai_routes_through_the_router(router, workers, model_dir):
    """The router rebuilds every request with all of SGLang's fields at their defaults; each
    route's answer equals the worker's own, token for token (greedy)."""
    body = {"text": "The quick brown fox", "sampling_params": GREEDY}
    via = requests.post(router.url + "/generate", json=body, timeout=120)
    assert via.status_code == 200, via.text
    direct = requests.post(workers[0].url + "/generate", json=body, timeout=120).json()
    assert via.json()["output_ids"] == direct["output_ids"] and len(direct["output_ids"]) == 6

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    assert model == str(model_dir)
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                     temperature=0)
    worker = openai.OpenAI(base_url=workers[1].url + "/v1", api_key="none", max_retries=0)
    assert done.choices[0].text == worker.completions.create(
        model=model, prompt="Once upon a time", max_tokens=5, temperature=0).choices[0].text
    assert done.usage.completion_tokens == 5
    messages = [{"role": "user", "content": "Say hello"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=5,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    assert chat.choices[0].message.content == worker.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0).choices[0].message.content


def test_streaming_through_the_router(router, model_dir):
    with requests.post(router.url + "/generate", stream=True, timeout=120,
                       json={"text": "def add(a, b):", "sampling_params": GREEDY,
                             "stream": True}) as r:
        assert r.status_code == 200, r.text
        events = _sse(r)
    assert len(events) >= 2 and len(events[-1]["output_ids"]) == 6
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=str(model_dir), messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 3 and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_requests_spread_over_both_workers(router, workers):
    before = [_requests_served(w.url) for w in workers]
    for i in range(6):
        r = requests.post(router.url + "/generate", timeout=120,
                          json={"text": f"request {i}", "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
    served = [_requests_served(w.url) - b for w, b in zip(workers, before)]
    assert served == [3, 3], served  # round robin


def test_failover_when_a_worker_is_killed(router, workers):
    """SIGKILL one worker (its process and children, by PID): every request still succeeds, on
    the one that is left."""
    victim, survivor = workers
    procs = [psutil.Process(victim.proc.pid), *map(psutil.Process, victim.child_pids)]
    for p in procs:
        p.kill()
    psutil.wait_procs(procs, timeout=30)
    before = _requests_served(survivor.url)
    for i in range(6):
        r = requests.post(router.url + "/generate", timeout=120,
                          json={"text": f"after the kill {i}", "sampling_params": GREEDY})
        assert r.status_code == 200, (r.text, router.log_tail())
        assert len(r.json()["output_ids"]) == 6
    assert _requests_served(survivor.url) - before == 6

"""The router (lockstep/router/): policies and the radix tree in-process, then the router as its
own process in front of three live tiny-model servers — cache-aware affinity, round robin,
streaming chunk by chunk, retries (a dead worker, a 5xx, never after bytes went out), the admin
routes, and a server SIGKILLed in the middle of a load of concurrent requests."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import requests

from lockstep.router.policies import (
    CacheAware,
    PowerOfTwo,
    RadixTree,
    RandomPolicy,
    RoundRobin,
    make_policy,
    routing_text,
)
from lockstep.testing.live_server import LiveServer
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_models import make_tiny_model
from lockstep.utils.process import free_port

SERVER_ARGS = ("--max-total-tokens", "16384", "--log-level", "warning")
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


# ---------------------------------------------------------------------------------------------
# In-process: the radix tree, the policies, the routing text


def test_radix_tree_match_insert_split():
    t = RadixTree()
    t.insert("hello world")
    t.insert("hello there")
    assert t.size == len("hello world") + len("there")
    assert t.match("hello wor") == 9
    assert t.match("hello world and more") == 11
    assert t.match("help") == 3
    assert t.match("xyz") == 0 and t.match("") == 0
    t.insert("hello")  # a prefix of what is there: no new characters
    assert t.size == len("hello world") + len("there")
    assert t.match("hello there") == 11


def test_radix_tree_lru_eviction_bounds_size():
    t = RadixTree(max_size=200)
    texts = [f"{i:03d}-" + "abcdefghij" * 3 for i in range(40)]
    for i, text in enumerate(texts):
        t.insert(text)
        if i >= 5:
            t.insert(texts[2])  # keep one old text in use
        assert t.size <= 200
    assert t.match(texts[-1]) == len(texts[-1])  # the newest survives
    assert t.match(texts[2]) == len(texts[2])  # so does the one in use
    assert t.match(texts[0]) < len(texts[0])  # the least recently used went
    assert t.evict(0) > 0 and t.size == 0


def _workers(*loads: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(url=f"w{i}", load=load) for i, load in enumerate(loads)]


def test_cache_aware_policy():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    ws = _workers(0, 0)
    prefix = "You are a helpful assistant. " * 10
    first = policy.select(ws, prefix + "question 0")
    assert all(policy.select(ws, prefix + f"question {i}") is first for i in range(1, 10))
    # a new prefix goes to the worker with the smallest tree
    other = policy.select(ws, "a completely different long prompt " * 5)
    assert other is not first
    # load imbalance past both thresholds overrides affinity ...
    first.load, other.load = 10, 0
    assert policy.select(ws, prefix + "question x") is other
    assert policy.decisions["balance"] == 1
    # ... but not past only one of them: both now hold the prefix, the less loaded wins the tie
    first.load, other.load = 10, 7
    assert policy.select(ws, prefix + "question y") is other
    assert policy.decisions == {"balance": 1, "cache_hit": 10, "cache_miss": 2}
    # a match below the threshold is a miss
    low = CacheAware(cache_threshold=0.9)
    a = low.select(ws, "abcdefghij")
    first.load = other.load = 0
    assert low.select(ws, "abcdeXXXXX") is not a
    policy.remove_worker("w0")
    assert "w0" not in policy.tree_sizes()


def test_simple_policies():
    ws = _workers(0, 0, 0)
    rr = RoundRobin()
    assert [rr.select(ws, "").url for _ in range(6)] == ["w0", "w1", "w2"] * 2
    picks = [RandomPolicy(seed=7).select(ws, "").url for _ in range(3)]
    assert picks == [RandomPolicy(seed=7).select(ws, "").url for _ in range(3)]  # seeded
    r = RandomPolicy(seed=1)
    assert {r.select(ws, "").url for _ in range(50)} == {"w0", "w1", "w2"}
    p2 = PowerOfTwo(seed=0)
    busy = _workers(5, 0)
    assert all(p2.select(busy, "").url == "w1" for _ in range(10))  # two of two: the idle one
    assert p2.select(busy[:1], "").url == "w0"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


def test_routing_text():
    assert routing_text("/generate", {"text": "hi"}) == "hi"
    assert routing_text("/generate", {"text": ["a", "b"]}) == "a"
    assert routing_text("/generate", {"input_ids": [1, 2, 3]}) == "1 2 3"
    assert routing_text("/generate", {"input_ids": [[4, 5], [6]]}) == "4 5"
    assert routing_text("/v1/completions", {"prompt": "p"}) == "p"
    assert routing_text("/v1/completions", {"prompt": [7, 8]}) == "7 8"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert routing_text("/v1/chat/completions", chat) == "<|system|>be brief\n<|user|>hello\n"
    assert routing_text("/generate", None) == "" == routing_text("/generate", [1])


# ---------------------------------------------------------------------------------------------
# Live: servers and routers as processes


class RouterProc:
    """`python -m lockstep.router ...` on a free port, stopped by its PID."""

    def __init__(self, workers: list[str], policy: str, *extra: str, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"router-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "lockstep.router", "--host", "127.0.0.1",
               "--port", str(self.port), "--policy", policy, "--health-check-interval", "0.5",
               "--log-level", "info", *extra]
        if workers:
            cmd += ["--worker-urls", *workers]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(requests.RequestException):
                requests.get(self.url + "/list_workers", timeout=2).raise_for_status()
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"router did not start:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def workers(self) -> dict[str, dict[str, Any]]:
        r = requests.get(self.url + "/list_workers", timeout=10)
        r.raise_for_status()
        return {w["url"]: w for w in r.json()["workers"]}

    def info(self) -> dict[str, Any]:
        return requests.get(self.url + "/get_router_info", timeout=10).json()

    def completed(self) -> dict[str, int]:
        return {url: w["completed"] for url, w in self.workers().items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router")


def _start_servers(count: int, log_dir: Path) -> list[LiveServer]:
    model = str(make_tiny_model("llama"))
    # Spawned here, in the main thread (their parent-death signal fires when the spawning thread
    # ends), then waited for: several start at once.
    started = [LiveServer("--model-path", model, *SERVER_ARGS, log_dir=log_dir, wait=False,
                          startup_timeout=240)
               for _ in range(count)]
    try:
        for s in started:
            s.wait_ready()
    except BaseException:
        for s in started:
            s.stop()
        raise
    return started


@pytest.fixture(scope="module")
@marks("server")
def _pool(log_dir: Path) -> list[LiveServer]:
    pool = _start_servers(2, log_dir)
    yield pool
    for s in pool:
        s.stop()


@pytest.fixture
def servers(_pool: list[LiveServer], log_dir: Path) -> list[LiveServer]:
    """Two tiny-model servers, started at once for the module; one the kill test killed (it runs
    last, but tests may be selected in any order) is replaced."""
    for i, s in enumerate(_pool):
        if not s.alive():
            s.stop()
            _pool[i] = _start_servers(1, log_dir)[0]
    return _pool


@pytest.fixture
@marks("server")
def make_router(log_dir: Path):
    made: list[RouterProc] = []

    def make(workers: list[str], policy: str, *extra: str) -> RouterProc:
        made.append(RouterProc(workers, policy, *extra, log_dir=log_dir))
        return made[-1]

    yield make
    for r in made:
        r.stop()


def post(url: str, path: str, body: dict[str, Any], timeout: float = 120) -> requests.Response:
    return requests.post(url + path, json=body, timeout=timeout)


def test_cache_aware_affinity(servers, make_router):
    a, b = servers[0].url, servers[1].url
    router = make_router([a, b], "cache_aware")
    before = router.completed()
    prefix = ("You are a meticulous assistant for the lockstep project; answer in one line. "
              * 8)

    def one(i: int) -> str:
        r = post(router.url, "/generate",
                 {"text": prefix + f"Question {i}: what is {i} + {i}?", "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        return r.json()["text"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(20)))
    after = router.completed()
    counts = {url: after[url] - before[url] for url in after}
    assert sum(counts.values()) == 20
    assert max(counts.values()) >= 18, counts  # >= 90 % to one worker
    info = router.info()["policy"]
    assert info["decisions"]["balance"] == 0  # the load stayed within the thresholds
    # A second prefix goes to the other worker (the one with the smaller tree).
    home = max(counts, key=counts.get)
    other_prefix = "Translate the following sentence into French, carefully. " * 8
    for i in range(3):
        r = post(router.url, "/v1/completions",
                 {"prompt": other_prefix + str(i), "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    final = router.completed()
    assert final[home] == after[home]
    assert sum(final.values()) - sum(after.values()) == 3
    # The workers' own metrics agree: one of them saw the shared prefix as cached tokens.
    assert max(_metric(url, "sglang:cached_tokens_total") for url in (a, b)) > 0


def test_round_robin_alternates(servers, make_router):
    a, b = servers[0].url, servers[1].url
    router = make_router([a, b], "round_robin")
    sequence = []
    last = router.completed()
    for i in range(6):
        r = post(router.url, "/generate", {"text": f"round {i}", "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        now = router.completed()
        (served,) = [url for url in now if now[url] != last[url]]
        sequence.append(served)
        last = now
    assert sequence[0::2] == [sequence[0]] * 3 and sequence[1::2] == [sequence[1]] * 3
    assert sequence[0] != sequence[1]


def test_proxied_routes(servers, make_router):
    a, b = servers[0].url, servers[1].url
    router = make_router([a, b], "power_of_two")
    assert requests.get(router.url + "/health", timeout=10).status_code == 200
    models = requests.get(router.url + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"]
    for name in ("model_info", "get_model_info"):
        info = requests.get(f"{router.url}/{name}", timeout=10).json()
        assert info["model_path"] and info["is_generation"] is True
    for name in ("server_info", "get_server_info"):
        server_info = requests.get(f"{router.url}/{name}", timeout=10).json()
        assert server_info["router"]["policy"]["policy"] == "power_of_two"
    ids = post(router.url, "/tokenize", {"prompt": "hello world"}).json()
    assert ids == post(a, "/v1/tokenize", {"prompt": "hello world"}).json()
    text = post(router.url, "/v1/detokenize", {"tokens": ids["tokens"]})
    assert text.status_code == 200 and text.json()["text"] == "hello world", text.text
    assert post(router.url, "/detokenize", {"tokens": "x"}).status_code == 400
    chat = post(router.url, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                 "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    bad = post(router.url, "/generate", {"text": "x", "sampling_params": {"temperature": -3}})
    assert bad.status_code == 400 and "error" in bad.json()  # the worker's 4xx, not retried
    assert router.info()["retries"] == 0
    flushed = requests.post(router.url + "/flush_cache", timeout=30)
    assert flushed.status_code == 200 and "2 worker" in flushed.text
    aborted = post(router.url, "/abort_request", {"rid": "no-such-request"})
    assert aborted.status_code == 200, aborted.text
    metrics = requests.get(router.url + "/metrics", timeout=10).text
    assert f'lockstep_router:healthy{{worker="{a}"}} 1.0' in metrics
    assert post(router.url, "/nope", {}).status_code == 404


def _stream_events(resp: requests.Response) -> list[tuple[float, dict[str, Any] | str]]:
    """(arrival time, event) for each SSE event, read as the bytes arrive."""
    out, buf = [], b""
    for chunk in resp.iter_content(chunk_size=None):
        now = time.perf_counter()
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            payload = event[len(b"data: "):]
            out.append((now, "[DONE]" if payload == b"[DONE]" else json.loads(payload)))
    return out


def test_streaming_passes_chunk_by_chunk(servers, make_router):
    router = make_router([servers[0].url, servers[1].url], "cache_aware")
    body = {"text": "Stream me a story about a fox", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    with requests.post(router.url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _stream_events(r)
    assert events[-1][1] == "[DONE]"
    data = [e for _, e in events[:-1]]
    assert len(data) > 8  # token by token (tokens may coalesce when the worker lags)
    assert len(data[-1]["output_ids"]) == 32
    assert data[-1]["meta_info"]["finish_reason"]["type"] == "length"
    times = sorted({t for t, _ in events})
    assert len(times) > 1 and times[-1] - times[0] > 0.005  # not buffered into one piece
    # The same through the OpenAI route.
    with requests.post(router.url + "/v1/completions", stream=True, timeout=120,
                       json={"prompt": "Once upon", "max_tokens": 16, "stream": True,
                             "temperature": 0}) as r:
        assert r.status_code == 200
        chunks = _stream_events(r)
    assert chunks[-1][1] == "[DONE]" and len(chunks) > 4
    assert len({t for t, _ in chunks}) > 1


def _metric(url: str, name: str) -> float:
    """A worker's counter, summed over its label sets."""
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def test_client_disconnect_aborts_at_the_worker(servers, make_router):
    """A client that leaves mid-stream (or before a plain answer) has its request closed at the
    worker: the router's in-flight count and the worker's running requests drop back to 0."""
    worker = servers[0].url
    router = make_router([worker], "round_robin")
    long = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}
    generated = _metric(worker, "sglang:generation_tokens_total")
    with requests.post(router.url + "/generate", stream=True, timeout=60,
                       json={"text": "never finish", "stream": True, "sampling_params": long}) as r:
        next(r.iter_content(chunk_size=None))  # the first event arrived: now leave
    with contextlib.suppress(requests.RequestException):  # a plain request, given up on
        requests.post(router.url + "/generate", timeout=1.0,
                      json={"text": "never finish either", "sampling_params": long})

    def idle() -> bool:
        running = requests.get(worker + "/get_server_info", timeout=10).json()
        return (router.workers()[worker]["load"] == 0
                and running["num_running_requests"] == 0)

    deadline = time.monotonic() + 30
    while not idle():
        assert time.monotonic() < deadline, (router.workers(), router.log()[-2000:])
        time.sleep(0.2)
    # Neither ran to its 2000 tokens: both were aborted, not finished.
    assert _metric(worker, "sglang:generation_tokens_total") - generated < 2000


def test_cli_entry_points():
    from lockstep.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["router", "--help"])
    assert exc.value.code == 0
    out = subprocess.run([sys.executable, "-m", "lockstep.router", "--policy", "fastest"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice" in out.stderr
    out = subprocess.run([sys.executable, "-m", "lockstep.router", "--worker-urls", "localhost:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "http://HOST:PORT" in out.stderr


def test_dead_worker_is_skipped_and_retried(servers, make_router):
    dead = f"http://127.0.0.1:{free_port()}"
    router = make_router([dead, servers[0].url], "round_robin")
    for i in range(4):
        r = post(router.url, "/generate", {"text": f"retry {i}", "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
    workers = router.workers()
    assert workers[dead]["healthy"] is False and workers[servers[0].url]["healthy"] is True
    assert requests.get(router.url + "/health", timeout=10).status_code == 200
    # Only dead workers: 503 on /health and on requests.
    lonely = make_router([dead], "round_robin")
    assert requests.get(lonely.url + "/health", timeout=10).status_code == 503
    r = post(lonely.url, "/generate", {"text": "x", "sampling_params": GREEDY})
    assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]


class FakeWorker:
    """A worker that is healthy, answers a plain /generate with a 500, and cuts a stream after its
    first event: the router must retry the first and never the second."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # /health
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.posts.append(body)
                if not body.get("stream"):
                    data = b'{"error": {"message": "boom", "code": 500}}'
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                event = b'data: {"text": "fake", "output_ids": [1]}\n\n'
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                time.sleep(0.2)
                self.close_connection = True
                self.connection.shutdown(2)  # gone mid-stream

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_retry_on_5xx_but_never_after_bytes(servers, make_router):
    fake = FakeWorker()
    try:
        real = servers[0].url
        router = make_router([fake.url, real], "round_robin")
        for i in range(2):  # one of the two lands on the fake first
            r = post(router.url, "/generate", {"text": f"five hundred {i}",
                                               "sampling_params": GREEDY})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        assert len(fake.posts) >= 1 and router.info()["retries"] == len(fake.posts)
        # A stream that the fake cuts after its first event reaches the client as it was, with
        # an error event and no [DONE]; the real worker never sees it.
        for _ in range(2):
            before_real, before_posts = router.completed()[real], len(fake.posts)
            body = {"text": "cut me", "stream": True, "sampling_params": GREEDY}
            with requests.post(router.url + "/generate", json=body, stream=True,
                               timeout=60) as r:
                assert r.status_code == 200
                events = [e for _, e in _stream_events(r)]
            if len(fake.posts) == before_posts:
                assert events[-1] == "[DONE]"  # served by the real worker
                continue
            assert events[0] == {"text": "fake", "output_ids": [1]}
            assert "[DONE]" not in events and "error" in events[-1]
            assert router.completed()[real] == before_real
            assert router.info()["retries"] == before_posts
            break
        else:
            pytest.fail("no stream went to the fake worker")
    finally:
        fake.stop()


def test_add_and_remove_worker(servers, make_router):
    a, b = servers[0].url, servers[1].url
    router = make_router([a], "round_robin")
    assert list(router.workers()) == [a]
    r = requests.post(router.url + "/add_worker", params={"url": b}, timeout=30)
    assert r.status_code == 200 and r.json()["worker"]["healthy"] is True, r.text
    assert requests.get(router.url + "/list_workers", timeout=10).json()["urls"] == [a, b]
    assert requests.post(router.url + "/add_worker", params={"url": b},
                         timeout=10).status_code == 400  # already there
    assert requests.post(router.url + "/add_worker", params={"url": "ftp://x"},
                         timeout=10).status_code == 400
    before = router.completed()
    for i in range(4):
        assert post(router.url, "/generate", {"text": f"add {i}",
                                              "sampling_params": GREEDY}).status_code == 200
    after = router.completed()
    assert after[a] - before[a] == 2 and after[b] - before[b] == 2
    r = requests.post(router.url + "/remove_worker", params={"url": a}, timeout=10)
    assert r.status_code == 200, r.text
    assert list(router.workers()) == [b]
    for i in range(3):
        assert post(router.url, "/generate", {"text": f"removed {i}",
                                              "sampling_params": GREEDY}).status_code == 200
    assert router.completed()[b] == after[b] + 3
    assert requests.post(router.url + "/remove_worker", params={"url": a},
                         timeout=10).status_code == 404


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill_worker_mid_load(servers, make_router):
    """SIGKILL one of two servers while ~40 requests are in flight: every request still gets
    exactly one 200 with its own full output."""
    survivor, victim = servers
    router = make_router([survivor.url, victim.url], "round_robin")
    n, tokens = 40, 64
    body = lambda i: {"text": f"Request number {i} of the load test",  # noqa: E731
                      "rid": f"load-{i}-{os.getpid()}",
                      "sampling_params": {"temperature": 0, "max_new_tokens": tokens,
                                          "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(post, router.url, "/generate", body(i)) for i in range(n)]
        deadline = time.monotonic() + 60
        while router.workers()[victim.url]["load"] < 5:
            assert time.monotonic() < deadline, "the load never reached the victim"
            assert not all(f.done() for f in futures)
            time.sleep(0.02)
        victim_children = list(victim.child_pids)
        os.kill(victim.proc.pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    victim.proc.wait(timeout=30)
    for i, r in enumerate(results):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["id"] == body(i)["rid"]
        assert len(out["output_ids"]) == tokens
    info = router.info()
    assert info["retries"] >= 1  # some requests were in flight on the victim
    workers = {w["url"]: w for w in info["workers"]}
    assert workers[victim.url]["healthy"] is False
    assert workers[victim.url]["completed"] + workers[survivor.url]["completed"] == n
    assert requests.get(router.url + "/health", timeout=10).status_code == 200
    # The victim's scheduler and detokenizer die with it.
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in victim_children):
        assert time.monotonic() < deadline, "the killed server left children behind"
        time.sleep(0.2)

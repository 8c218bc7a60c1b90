"""The reliability suite: what a live server survives (docs/reliability.md has the figures).

Each test has a short form, in the default run, and a long form marked `soak` (`make soak`):

- soak: random prompt and output lengths, 64 requests at a time, through a KV pool small enough
  that requests are retracted; nothing fails or is lost, every output equals the same request
  run alone, no KV leaks, RSS stays flat;
- disconnect storm: streaming clients that hang up at random points;
- faults: SIGKILL of each kind of child, SIGSTOP of a scheduler (the watchdog fires);
- graceful SIGTERM, /health while starting and draining, and the request limits.

API fuzzing and hostile input (schemathesis, grammars, slow clients) are in test_hostile_inputs.py.

Every server here runs a tiny random-weight model in float32, so greedy outputs are exact.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import requests

from lockstep.testing.corpus import random_prompt
from lockstep.testing.live_server import LiveServer
from lockstep.testing.reliability import (
    API_KEY,
    AUTH,
    FORMS,
    LONG,
    MODEL_ARGS,
    SHORT,
    generate,
    report,
)
from lockstep.testing.tiers import marks

pytestmark = pytest.mark.usefixtures("passive_openmp_threads")


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# ---------------------------------------------------------------------------------------------
# Process helpers


def tree(server: LiveServer) -> list[int]:
    return [server.proc.pid, *server.child_pids]


def gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def child(server: LiveServer, title: str) -> int:
    """The child whose process title starts with `title` (e.g. "lockstep::scheduler DP1 TP1")."""
    for pid in server.child_pids:
        with contextlib.suppress(psutil.NoSuchProcess, IndexError):
            if psutil.Process(pid).cmdline()[0].startswith(title):
                return pid
    raise AssertionError(f"no child titled {title!r} among {server.child_pids}")


def signal_child(server: LiveServer, title: str, sig: int, pids: list[int],
                 exit_timeout: float) -> tuple[int, float, list[int]]:
    """Send `sig` to the child titled `title`; return the server's exit code, the seconds it
    took to exit, and which of `pids` are still alive 10 s later."""
    target = child(server, title)
    start = time.monotonic()
    os.kill(target, sig)
    code = server.proc.wait(timeout=exit_timeout)
    return code, time.monotonic() - start, gone(pids, 10)


def kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            p.send_signal(signal.SIGCONT)
            p.kill()


def wait_scheduler_idle(url: str, timeout: float = 60.0) -> None:
    """/flush_cache succeeds only when no request is waiting or running in any scheduler, and
    runs the KV integrity check there (a leak is logged as "KV leak at idle")."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        info = requests.get(url + "/get_server_info", headers=AUTH, timeout=30).json()
        if info["num_running_requests"] == 0:
            r = requests.post(url + "/flush_cache", headers=AUTH, timeout=60)
            if r.status_code == 200:
                return
            last = r.text
        time.sleep(0.2)
    raise AssertionError(f"the server did not become idle within {timeout} s: {last}")


# ---------------------------------------------------------------------------------------------
# A tiny async HTTP client: many concurrent streams, and hanging up at will


@dataclass
class Outcome:
    status: int | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    error: str | None = None
    events: int = 0


def _request_bytes(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode() + data


async def post_generate(port: int, body: dict, hang_up_after: int | None = None,
                        hang_up_at: float | None = None, rst: bool = False) -> Outcome:
    """POST /generate over a raw connection. A stream is read event by event; with
    `hang_up_after` events (or at `hang_up_at` seconds) the client disconnects: with a RST when
    `rst`, else with a FIN."""
    out = Outcome()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    try:
        writer.write(_request_bytes("/generate", body))
        await writer.drain()
        if hang_up_after == 0 and hang_up_at is None:
            return out
        head = await reader.readuntil(b"\r\n\r\n")
        out.status = int(head.split(b" ", 2)[1])
        headers = head.decode("latin-1").lower()
        if "transfer-encoding: chunked" not in headers:
            length = int(re.search(r"content-length: (\d+)", headers).group(1))
            payload = json.loads(await reader.readexactly(length))
            if out.status != 200:
                out.error = f"{out.status}: {payload}"
            else:
                out.output_ids = payload["output_ids"]
                out.finish_reason = payload["meta_info"]["finish_reason"]
            return out
        buf = b""
        while True:
            if hang_up_after is not None and out.events >= hang_up_after:
                return out
            if hang_up_at is not None and time.monotonic() - start >= hang_up_at:
                return out
            chunk = await reader.read(65536)
            if not chunk:
                out.error = out.error or "stream ended without [DONE]"
                return out
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                line = (b"\n" + event).split(b"\ndata: ", 1)[-1].strip()
                if line == b"[DONE]":
                    return out
                if line.startswith(b"{"):
                    with contextlib.suppress(ValueError):
                        data = json.loads(line)
                        out.events += 1
                        out.output_ids = data.get("output_ids", out.output_ids)
                        out.finish_reason = data.get("meta_info", {}).get("finish_reason")
    except (OSError, asyncio.IncompleteReadError, ValueError, AttributeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        if rst:
            with contextlib.suppress(OSError):
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()


# ---------------------------------------------------------------------------------------------
# Soak under KV pressure


@dataclass
class Job:
    rid: str
    ids: list[int]
    max_new: int
    stream: bool


SOAK = {SHORT: 200, LONG: 2000}
KV_POOL = 500  # tokens: 64 requests of up to 120 + 64 tokens do not fit
SOAK_CONCURRENCY = 64


def soak_jobs(tokenizer: Any, n: int, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        ids = tokenizer(random_prompt(rng, rng.randint(2, 60))).input_ids[:120]
        jobs.append(Job(f"soak-{i}", ids, rng.randint(1, 64), stream=rng.random() < 0.5))
    return jobs


def references(model_dir: str, jobs: list[Job]) -> dict[str, list[int]]:
    """Each request run alone (batch of one) through the same scheduler code, in-process."""
    import torch

    from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sched = make_scheduler(model_dir, max_total_tokens=8192)
        out = {}
        for job in jobs:
            done = run_to_completion(sched, [greedy_req(job.rid, job.ids, job.max_new)])
            out[job.rid] = done[job.rid].output_ids
        return out
    finally:
        torch.set_num_threads(threads)


class RssSampler:
    """RSS of the given processes, sampled every `period` s with the number of finished requests."""

    def __init__(self, pids: dict[str, int], progress: list[int], period: float = 0.25) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.progress = progress
        self.samples: list[tuple[int, dict[str, int]]] = []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            with contextlib.suppress(psutil.Error):
                self.samples.append((self.progress[0], {n: p.memory_info().rss
                                                        for n, p in self.procs.items()}))
            self.stop_event.wait(0.25)

    def __enter__(self) -> RssSampler:
        self.thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.stop_event.set()
        self.thread.join()

    def growth(self, total: int) -> dict[str, tuple[float, float, float]]:
        """Per process: (MiB at the end of the first quarter, max MiB in the last, growth)."""
        out = {}
        for name in self.procs:
            first = [s[name] for done, s in self.samples if done <= total // 4]
            last = [s[name] for done, s in self.samples if done >= total - total // 4]
            base, peak = first[-1], max(last)
            out[name] = (base / 2**20, peak / 2**20, peak / base - 1)
        return out


@pytest.fixture(scope="module")
@marks("server")
def pressure_server(model_dir, tmp_path_factory):
    """A server with a KV pool small enough that 64 running requests get retracted: the soak and
    the disconnect storm both run on it. It must still exit 0 on SIGTERM afterwards."""
    server = LiveServer("--model-path", model_dir, *MODEL_ARGS, "--api-key", API_KEY,
                        "--max-total-tokens", str(KV_POOL),
                        "--max-running-requests", str(SOAK_CONCURRENCY),
                        log_dir=tmp_path_factory.mktemp("pressure"))
    yield server
    server.stop()
    assert server.proc.returncode == 0, server.log_tail()


@pytest.mark.parametrize("form", FORMS)
def test_soak_under_kv_pressure(pressure_server, model_dir, tokenizer, form):
    server = pressure_server
    jobs = soak_jobs(tokenizer, SOAK[form], seed=0 if form == SHORT else 1)
    retracted_before = server.log_text().count("KV pool full: retracted")
    scheduler = child(server, "lockstep::scheduler")
    # The references (each request alone, in this process) are computed meanwhile.
    refs_pool = concurrent.futures.ThreadPoolExecutor(1)
    refs_future = refs_pool.submit(references, model_dir, jobs)
    done = [0]

    async def run() -> list[Outcome]:
        sem = asyncio.Semaphore(SOAK_CONCURRENCY)

        async def one(job: Job) -> Outcome:
            async with sem:
                out = await post_generate(server.port, {
                    "input_ids": job.ids, "rid": job.rid, "stream": job.stream,
                    "sampling_params": {"max_new_tokens": job.max_new, "temperature": 0,
                                        "ignore_eos": True}})
            done[0] += 1
            return out

        return await asyncio.gather(*(one(j) for j in jobs))

    start = time.monotonic()
    with RssSampler({"front": server.proc.pid, "scheduler": scheduler}, done) as rss:
        outcomes = asyncio.run(run())
    took = time.monotonic() - start
    wait_scheduler_idle(server.url)
    time.sleep(1.0)  # a few idle steps: each runs the integrity check
    log = server.log_text()
    assert server.alive(), server.log_tail()

    failed = [(j.rid, o.error or o.status) for j, o in zip(jobs, outcomes)
              if o.error or o.status != 200]
    assert not failed, f"{len(failed)} failed: {failed[:5]}"
    lost = [j.rid for j, o in zip(jobs, outcomes)
            if o.finish_reason != {"type": "length", "length": j.max_new}]
    assert not lost, f"{len(lost)} requests ended early or never ended: {lost[:5]}"
    retractions = log.count("KV pool full: retracted") - retracted_before
    assert retractions > 0, "the KV pool was not small enough to force a retraction"
    assert "KV leak at idle" not in log
    assert "Traceback" not in log

    refs = refs_future.result()
    refs_pool.shutdown()
    wrong = [j.rid for j, o in zip(jobs, outcomes) if o.output_ids != refs[j.rid]]
    assert not wrong, f"{len(wrong)} outputs differ from the same request alone: {wrong[:5]}"

    growth = rss.growth(len(jobs))
    report(f"soak[{form}]", requests=len(jobs), concurrency=SOAK_CONCURRENCY,
           kv_pool=KV_POOL, seconds=took, tokens=sum(j.max_new for j in jobs),
           retractions=retractions, failed=0, lost=0, mismatched=0,
           **{f"rss_{n}_mib": f"{a:.0f}->{b:.0f} ({g:+.1%})" for n, (a, b, g) in growth.items()})
    for name, (_a, _b, g) in growth.items():
        assert g < 0.05, f"{name} RSS grew {g:.1%} between the first and last quarter"


# ---------------------------------------------------------------------------------------------
# Disconnect storm

STORM = {SHORT: 200, LONG: 2000}


@pytest.mark.parametrize("form", FORMS)
def test_disconnect_storm(pressure_server, form):
    """Clients hang up before the response starts, after a few events, or at a random moment,
    with a FIN or a RST, or have their request aborted by /abort_request while they read it,
    while their requests wait, run, or are retracted (the KV pool is small). Every aborted
    request ends with an abort (or its length, when it finished first): none is lost; the
    front's and the scheduler's memory after the storm is back to its level after warm-up."""
    n = STORM[form]
    server = pressure_server
    rng = random.Random(1)
    done = [0]
    aborted: dict[int, Outcome] = {}

    async def abort_later(rid: str, after: float) -> None:
        await asyncio.sleep(after)
        await asyncio.to_thread(requests.post, server.url + "/abort_request", headers=AUTH,
                                json={"rid": rid}, timeout=60)

    async def storm() -> list[Outcome]:
        async def one(i: int) -> Outcome:
            await asyncio.sleep(rng.random() * 2.0)
            body = {"text": random_prompt(rng, rng.randint(2, 30)), "stream": True,
                    "sampling_params": {"max_new_tokens": rng.randint(20, 300),
                                        "ignore_eos": True, "temperature": 0}}
            kind = rng.random()
            if kind < 0.2:  # gone before the first byte of the response
                return await post_generate(server.port, body, hang_up_after=0, rst=i % 2 == 0)
            if kind < 0.5:  # after a few events
                return await post_generate(server.port, body, hang_up_after=rng.randint(1, 20),
                                           rst=i % 2 == 0)
            if kind < 0.7:  # aborted by rid while it streams or waits
                body["rid"] = f"storm-{form}-{i}"
                abort = asyncio.ensure_future(abort_later(body["rid"], rng.random() * 3.0))
                aborted[i] = await post_generate(server.port, body)
                await abort
                return aborted[i]
            return await post_generate(server.port, body, hang_up_at=rng.random() * 3.0,
                                       rst=i % 2 == 0)

        sem = asyncio.Semaphore(200)

        async def limited(i: int) -> Outcome:
            async with sem:
                out = await one(i)
            done[0] += 1
            return out

        return await asyncio.gather(*(limited(i) for i in range(n)))

    scheduler = child(server, "lockstep::scheduler")
    start = time.monotonic()
    with RssSampler({"front": server.proc.pid, "scheduler": scheduler}, done) as rss:
        asyncio.run(storm())
    took = time.monotonic() - start
    t0 = time.monotonic()
    wait_scheduler_idle(server.url, timeout=60)
    drained = time.monotonic() - t0
    out = generate(server.url, "after the storm", 12)
    assert len(out["output_ids"]) == 12
    time.sleep(1.0)
    log = server.log_text()
    assert server.alive()
    assert "KV leak at idle" not in log
    assert "Traceback" not in log, log[-3000:]
    lost = [i for i, o in aborted.items()
            if o.error or (o.finish_reason or {}).get("type") not in ("abort", "length")]
    assert not lost, f"{len(lost)} aborted requests lost: {[aborted[i] for i in lost[:3]]}"
    ended_aborted = sum(o.finish_reason["type"] == "abort" for o in aborted.values())
    assert ended_aborted, "no abort arrived while its request ran"
    growth = rss.growth(n)
    report(f"disconnect_storm[{form}]", clients=n, aborted=len(aborted),
           ended_aborted=ended_aborted, seconds=took,
           idle_after_s=drained,
           **{f"rss_{k}_mib": f"{a:.0f}->{b:.0f} ({g:+.1%})" for k, (a, b, g) in growth.items()})
    if form == LONG:  # the short storm is too brief for its first quarter to be warm
        for name, (_a, _b, g) in growth.items():
            assert g < 0.05, f"{name} RSS grew {g:.1%} between the first and last quarter"


# ---------------------------------------------------------------------------------------------
# Faults

# (victim, tp size). The DP controller's case runs dp 2 x tp 1 (2 schedulers): what it proves
# is that the controller's death is noticed; that a dp 2 x tp 2 tree goes down whole, TP ranks
# included, is scheduler-other-rank's case.
KILL_VICTIMS = [
    pytest.param("lockstep::data_parallel_controller", 1, id="dp-controller"),
    pytest.param("lockstep::scheduler DP1 TP1", 2, id="scheduler-other-rank"),
    pytest.param("lockstep::scheduler DP0 TP0", 2, id="scheduler-rank0", marks=pytest.mark.soak),
    pytest.param("lockstep::detokenizer", 2, id="detokenizer", marks=pytest.mark.soak),
]


@pytest.mark.server
@pytest.mark.parametrize("victim,tp", KILL_VICTIMS)
def test_sigkill_of_a_child_ends_the_server(model_dir, tmp_path, victim, tp):
    """dp 2 x tp 2: 4 schedulers, the DP controller and the detokenizer (dp 2 x tp 1: 2). SIGKILL
    runs no Python in the child: only the front process's watchdog on the children's sentinels
    can notice."""
    server = LiveServer("--model-path", model_dir, *MODEL_ARGS, "--dp-size", "2", "--tp-size",
                        str(tp), "--max-total-tokens", "4096", log_dir=tmp_path)
    pids = tree(server)
    try:
        titles = [psutil.Process(p).cmdline()[0] for p in server.child_pids]
        # 2 x tp schedulers, the DP controller, the detokenizer (+ mp's tracker)
        assert sum(t.startswith("lockstep::") for t in titles) == 2 * tp + 2, titles
        generate(server.url, "before the fault")  # (no API key on this one)
        load = concurrent.futures.ThreadPoolExecutor(4)
        for i in range(4):  # under load: requests in flight when the child dies
            load.submit(lambda i=i: requests.post(server.url + "/generate", timeout=60, json={
                "text": f"load {i}", "sampling_params": {"max_new_tokens": 2000,
                                                         "ignore_eos": True}}))
        time.sleep(0.5)
        code, took, left = signal_child(server, victim, signal.SIGKILL, pids, exit_timeout=10)
        load.shutdown(wait=False, cancel_futures=True)
    finally:
        kill_leftovers(pids)
        server.stop()
    assert code != 0
    assert not left, f"processes left behind: {left}"
    assert f"exited with code -{int(signal.SIGKILL)}" in server.log_text(), server.log_tail()
    report(f"sigkill[{victim}]", exit_code=code, exit_seconds=took)


STOP_VICTIMS = [
    pytest.param("lockstep::scheduler TP1", id="tp1"),
    pytest.param("lockstep::scheduler TP0", id="tp0", marks=pytest.mark.soak),
]


@pytest.mark.server
@pytest.mark.parametrize("victim", STOP_VICTIMS)
def test_sigstop_of_a_scheduler_fires_the_watchdog(model_dir, tmp_path, victim):
    """A stopped rank runs nothing, not even its own watchdog; its peer waits in a collective
    with a batch in hand, finishes no step, and its watchdog takes the server down."""
    timeout = 3.0
    server = LiveServer("--model-path", model_dir, *MODEL_ARGS, "--tp-size", "2",
                        "--watchdog-timeout", str(timeout), log_dir=tmp_path)
    pids = tree(server)
    try:
        generate(server.url, "before the fault")
        pool = concurrent.futures.ThreadPoolExecutor(1)
        pool.submit(lambda: requests.post(server.url + "/generate", timeout=60, json={
            "text": "a long one", "sampling_params": {"max_new_tokens": 3000,
                                                      "ignore_eos": True}}))
        time.sleep(1.0)
        code, took, left = signal_child(server, victim, signal.SIGSTOP, pids,
                                        exit_timeout=timeout + 15)
        pool.shutdown(wait=False, cancel_futures=True)
    finally:
        kill_leftovers(pids)
        server.stop()
    log = server.log_text()
    assert code != 0
    assert not left, f"processes left behind: {left}"
    assert "watchdog: scheduler" in log and "without finishing a step" in log, log[-3000:]
    assert "Thread 0x" in log and "File " in log, "no stack dump in the log"
    report(f"sigstop[{victim}]", watchdog_timeout=timeout, exit_code=code, exit_seconds=took)


def test_watchdog_fires_only_when_busy_and_stalled(tmp_path):
    from lockstep.utils.watchdog import ForwardProgressWatchdog

    fired = threading.Event()
    dump = open(tmp_path / "stacks.txt", "w")  # noqa: SIM115
    dog = ForwardProgressWatchdog(0.3, "test", on_fire=fired.set, dump_to=dump).start()
    dog.step_done(busy=False)
    assert not fired.wait(0.8), "an idle scheduler must never fire"
    for _ in range(8):  # busy, but steps keep finishing
        dog.step_begins(True)
        time.sleep(0.1)
        dog.step_done(True)
    assert not fired.is_set()
    dog.step_begins(True)  # a step that never finishes
    assert fired.wait(3.0)
    assert dog.fired
    dump.close()
    stacks = (tmp_path / "stacks.txt").read_text()
    assert "test_watchdog_fires_only_when_busy_and_stalled" in stacks  # every thread's stack


# ---------------------------------------------------------------------------------------------
# Startup, graceful SIGTERM and the limits


def test_health_status_follows_the_phase():
    from lockstep.entrypoints.middleware import ServerStatus

    class FakeLaunched:
        failed = None

    launched = FakeLaunched()
    status = ServerStatus(launched)  # type: ignore[arg-type]
    assert "starting" in status.unavailable()
    status.phase = "ready"
    assert status.unavailable() is None
    launched.failed = "child process detokenizer (pid 1) exited with code -9"
    assert "going down" in status.unavailable()
    launched.failed = None
    status.phase = "draining"
    assert "shutting down" in status.unavailable()


def test_the_startup_responder_answers_503_then_leaves_the_socket_listening():
    from lockstep.entrypoints.middleware import ServerStatus
    from lockstep.entrypoints.serve import StartupResponder
    from lockstep.server_args import ServerArgs

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    responder = StartupResponder(sock, ServerStatus(), ServerArgs(timeout_request_read=1.0))
    responder.start()
    try:
        deadline = time.monotonic() + 30
        while True:  # its thread may still be starting: the connection waits in the backlog
            try:
                r = requests.post(f"http://127.0.0.1:{port}/generate", json={"text": "a"},
                                  timeout=5)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert "starting" in r.json()["error"]["message"]
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        assert slow.recv(1024).startswith(b"HTTP/1.1 408"), "the read timeout applies"
        slow.close()
    finally:
        responder.stop()
    late = socket.create_connection(("127.0.0.1", port), timeout=5)  # still listening
    late.close()
    sock.close()


@pytest.mark.server
def test_limits_startup_and_graceful_sigterm(model_dir, tmp_path):
    """One server: /health is 503 while it starts; the queue limit answers 503 + Retry-After;
    SIGTERM refuses new work with 503, lets short requests finish, aborts the one that would
    outlast --graceful-shutdown-timeout, and exits 0 with nothing left."""
    # 2 s: the 4000-token request needs over 4 s even on a fast quiet machine (about 1 ms a token
    # on the tiny model), so it cannot finish inside the grace; 6 s let it finish on CI's EPYC.
    grace = 2.0
    server = LiveServer("--model-path", model_dir, *MODEL_ARGS, "--max-running-requests", "3",
                        "--max-queued-requests", "1", "--graceful-shutdown-timeout", str(grace),
                        "--max-prompt-tokens", "40", "--max-batch-size", "8",
                        "--max-request-body-bytes", str(1 << 20), log_dir=tmp_path)
    pids = tree(server)
    try:
        assert 503 in server.startup_health and server.startup_health[-1] == 200, \
            server.startup_health
        url = server.url
        # Limits that answer 4xx.
        long_prompt = " ".join(["word"] * 200)
        r = requests.post(url + "/generate", json={"text": long_prompt}, timeout=60)
        assert r.status_code == 400 and "--max-prompt-tokens" in r.text, r.text
        r = requests.post(url + "/generate", json={"text": ["a"] * 5, "sampling_params": {"n": 2}},
                          timeout=60)
        assert r.status_code == 400 and "--max-batch-size" in r.text, r.text
        r = requests.post(url + "/generate", json={"text": "a", "sampling_params": {"n": 17}},
                          timeout=60)
        assert r.status_code == 400 and "sampling_params.n" in r.text, r.text
        r = requests.post(url + "/generate", json={
            "text": "a", "sampling_params": {"max_new_tokens": 10**6}}, timeout=60)
        assert r.status_code == 400 and "context length" in r.text
        r = requests.post(url + "/generate", data=b'{"text": "' + b"a" * (2 << 20) + b'"}',
                          timeout=60)
        assert r.status_code == 413
        # The queue limit: 3 running + 1 queued, then 503 with Retry-After.
        body = {"text": "hold", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        holders = concurrent.futures.ThreadPoolExecutor(4)
        futures = [holders.submit(requests.post, url + "/generate", json={**body, "rid": f"h{i}"},
                                  timeout=120) for i in range(4)]
        deadline = time.monotonic() + 30
        while requests.get(url + "/get_server_info", timeout=10).json()[
                "num_running_requests"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = requests.post(url + "/generate", json={"text": "one too many"}, timeout=60)
        assert r.status_code == 503 and r.headers.get("Retry-After"), (r.status_code, r.text)
        assert "--max-queued-requests" in r.json()["error"]["message"]
        requests.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
        for f in futures:
            f.result(timeout=60)
        holders.shutdown()
        wait_scheduler_idle(url)

        # Graceful SIGTERM: two requests that finish in time, one that cannot.
        async def during_drain() -> tuple[list[Outcome], list[tuple[str, int, str | None]]]:
            def body_of(n: int) -> dict:
                return {"text": "drain me", "stream": True,
                        "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}

            tasks = [asyncio.create_task(post_generate(server.port, body_of(n)))
                     for n in (16, 24, 4000)]
            await asyncio.sleep(1.0)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            seen = []
            for path in ("/health", "/generate"):
                resp = await asyncio.to_thread(
                    requests.request, "GET" if path == "/health" else "POST", url + path,
                    json=None if path == "/health" else {"text": "late"}, timeout=30)
                seen.append((path, resp.status_code, resp.headers.get("Retry-After")))
            return list(await asyncio.gather(*tasks)), seen

        start = time.monotonic()
        outcomes, seen = asyncio.run(during_drain())
        code = server.proc.wait(timeout=grace + 20)
        took = time.monotonic() - start
        left = gone(pids, 10)
    finally:
        kill_leftovers(pids)
        server.stop()
    assert seen == [("/health", 503, "1"), ("/generate", 503, "1")], seen
    assert [o.finish_reason and o.finish_reason["type"] for o in outcomes] == \
        ["length", "length", "abort"], outcomes
    assert code == 0, server.log_tail()
    assert not left
    assert "aborting them" in server.log_text()
    report("graceful_sigterm", grace_s=grace, exit_seconds=took, finished=2, aborted=1)

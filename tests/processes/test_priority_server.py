"""Priority scheduling against a live TP 2 server with the lockstep check on every step: the
`priority` field on /generate and /v1/completions, an urgent request overtaking a full KV pool
and a queue, every output what the request gives alone; and a priority refused (400) by a server
that does not schedule by it."""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
from pathlib import Path

import pytest
import requests

from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.live_server import API_KEY, LiveServer

PROMPT_LEN, MAX_NEW, LOW_NEW, LOWS = 40, 40, 160, 6
POOL = 3 * (PROMPT_LEN + LOW_NEW) + 8  # three lows' worth of KV: the rest queue


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 500) for _ in range(PROMPT_LEN)] for _ in range(n)]


@pytest.mark.server
def test_urgent_request_overtakes_lows_on_tp2_in_lockstep(model_dir: Path, tmp_path: Path) -> None:
    lows, (urgent,) = _prompts(LOWS, 11), _prompts(1, 12)
    ref = run_to_completion(make_scheduler(model_dir, max_total_tokens=4000),
                            [*(greedy_req(f"r{i}", p, LOW_NEW) for i, p in enumerate(lows)),
                             greedy_req("urgent", urgent, MAX_NEW)])
    srv = LiveServer("--model-path", str(model_dir), "--tp-size", "2", "--dtype", "float32",
                     "--max-total-tokens", str(POOL), "--new-token-ratio", "1.0",
                     "--enable-priority-scheduling", "--enable-lockstep-check", "1",
                     "--disable-speculative-decoding", log_dir=tmp_path, startup_timeout=180)
    done: list[str] = []
    lock = threading.Lock()
    decoding = threading.Event()  # a low has streamed some tokens: the pool is full of them
    sampling = {"max_new_tokens": LOW_NEW, "temperature": 0.0, "ignore_eos": True}

    def low(i: int) -> list[int]:
        ids: list[int] = []
        with requests.post(srv.url + "/generate", stream=True, timeout=300, json={
                "input_ids": lows[i], "sampling_params": sampling, "priority": 0,
                "stream": True}) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    ids = json.loads(line[6:])["output_ids"]
                    if len(ids) >= 8:
                        decoding.set()
        with lock:
            done.append(f"low{i}")
        return ids

    try:
        with concurrent.futures.ThreadPoolExecutor(LOWS) as pool:
            futs = [pool.submit(low, i) for i in range(LOWS)]
            assert decoding.wait(120)
            r = requests.post(srv.url + "/v1/completions", json={
                "prompt": urgent, "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True,
                "priority": 10_000}, timeout=300)
            assert r.status_code == 200, r.text
            with lock:
                done.append("urgent")
            outs = [f.result() for f in futs]
        assert outs == [ref[f"r{i}"].output_ids for i in range(LOWS)]
        assert r.json()["choices"][0]["text"]
        assert r.json()["usage"]["completion_tokens"] == MAX_NEW
        # The urgent one arrived behind a full pool and a queue; it finished before at least the
        # queued half of the lows (without priorities it would finish last: FCFS).
        assert done.index("urgent") <= LOWS // 2, done
        assert srv.alive(), srv.log_tail()
        assert "lockstep check failed" not in srv.log_text(), srv.log_tail()
    finally:
        srv.stop()


@pytest.mark.server
def test_priority_is_a_400_without_priority_scheduling(llama_server: LiveServer) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = requests.post(llama_server.url + "/generate", headers=auth, json={
        "text": "hi", "sampling_params": {"max_new_tokens": 2}, "priority": 3}, timeout=60)
    assert r.status_code == 400 and "--enable-priority-scheduling" in r.text, r.text
    r = requests.post(llama_server.url + "/v1/chat/completions", headers=auth, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 3},
        timeout=60)
    assert r.status_code == 400 and "--enable-priority-scheduling" in r.text, r.text
    r = requests.post(llama_server.url + "/generate", headers=auth, json={
        "text": "hi", "sampling_params": {"max_new_tokens": 2}, "priority": None}, timeout=60)
    assert r.status_code == 200, r.text

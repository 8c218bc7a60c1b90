"""Replicas added to and removed from a running --dp-size 2 server through the admin routes, under
a steady stream of requests: every request answered once, with the output it has alone; the new
replica takes traffic once warm; the removed one drains, takes nothing more, and its processes
end while the server serves on."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.live_server import LiveServer

KEY = "sk-elastic"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NEW, WORKERS = 12, 4


def _scheduler_pids(srv: LiveServer, dp_rank: int) -> list[int]:
    out = []
    for c in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            if f"DP{dp_rank} TP" in " ".join(c.cmdline()) or f"scheduler-DP{dp_rank}-" in c.name():
                out.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.server
def test_replicas_join_and_leave_under_a_steady_stream(model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(6, 500) for _ in range(rng.randint(8, 40))] for _ in range(6)]
    ref = run_to_completion(make_scheduler(model_dir, max_total_tokens=4000),
                            [greedy_req(f"p{i}", p, MAX_NEW) for i, p in enumerate(prompts)])
    srv = LiveServer("--model-path", str(model_dir), "--dp-size", "2", "--api-key", KEY,
                     "--max-total-tokens", "4096", log_dir=tmp_path, startup_timeout=180)
    sent: list[tuple[str, int, float]] = []  # (rid, prompt, time sent)
    got: dict[str, list[tuple[list[int], int, float]]] = {}
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def stream(worker: int) -> None:
        n = 0
        while not stop.is_set():
            rid, which = f"w{worker}-{n}", (worker + n) % len(prompts)
            n += 1
            with lock:
                sent.append((rid, which, time.monotonic()))
            r = requests.post(srv.url + "/generate", headers=AUTH, timeout=120, json={
                "rid": rid, "input_ids": prompts[which], "sampling_params": {
                    "max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}})
            with lock:
                if r.status_code != 200:
                    errors.append(f"{rid}: {r.status_code} {r.text}")
                    continue
                body = r.json()
                got.setdefault(rid, []).append((body["output_ids"], body["meta_info"]["dp_rank"],
                                                time.monotonic()))

    threads = [threading.Thread(target=stream, args=(w,)) for w in range(WORKERS)]
    try:
        assert requests.post(srv.url + "/admin/replicas").status_code == 401  # no key
        for t in threads:
            t.start()
        time.sleep(2)
        r = requests.post(srv.url + "/admin/replicas", headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json() == {"replicas": ["active", "active", "active"], "dp_rank": 2}
        added_at = time.monotonic()
        time.sleep(2)
        doomed = _scheduler_pids(srv, 0)
        assert doomed, "replica 0's scheduler process not found"
        r = requests.delete(srv.url + "/admin/replicas/0", headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json() == {"replicas": ["retired", "active", "active"], "dp_rank": 0}
        removed_at = time.monotonic()
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    try:
        assert not errors, errors[:5]
        # Every request sent was answered exactly once, with its output alone.
        assert sorted(got) == sorted(rid for rid, _, _ in sent)
        assert all(len(v) == 1 for v in got.values())
        for rid, which, _ in sent:
            assert got[rid][0][0] == ref[f"p{which}"].output_ids, rid
        served = {rid: got[rid][0][1] for rid, _, _ in sent}
        after_add = [served[rid] for rid, _, t in sent if t > added_at]
        after_remove = [served[rid] for rid, _, t in sent if t > removed_at]
        assert 2 in after_add, "the new replica took no traffic"
        assert after_remove and 0 not in after_remove, after_remove
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                       for p in doomed), "replica 0's processes outlived its removal"
        # Mistakes are 4xx, and the server serves on.
        assert requests.delete(srv.url + "/admin/replicas/0", headers=AUTH).status_code == 404
        r = requests.post(srv.url + "/generate", headers=AUTH, json={
            "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "routed_dp_rank": 0})
        assert r.status_code == 400, r.text
        assert requests.get(srv.url + "/admin/replicas", headers=AUTH).json()["replicas"] == [
            "retired", "active", "active"]
        assert srv.alive(), srv.log_tail()
        assert requests.post(srv.url + "/flush_cache", headers=AUTH).status_code == 200
    finally:
        srv.stop()


@pytest.mark.server
def test_a_new_replica_serves_the_adapters_the_others_have(model_dir: Path, tmp_path: Path) -> None:
    """Adapters loaded and unloaded while serving are replayed onto a replica added later: it serves
    the run-time adapter with replica 0's tokens, and has the unloaded one unloaded too."""
    from lockstep.testing.lora_adapters import make_peft_adapter

    a = make_peft_adapter(model_dir, tmp_path / "a", seed=31, rank=8)
    b = make_peft_adapter(model_dir, tmp_path / "b", seed=32, rank=8)
    srv = LiveServer("--model-path", str(model_dir), "--dp-size", "2", "--api-key", KEY,
                     "--max-total-tokens", "4096", "--lora-paths", f"a={a}", "--max-lora-rank", "8",
                     log_dir=tmp_path, startup_timeout=180)
    try:
        def gen(dp: int, adapter: str | None) -> requests.Response:
            return requests.post(srv.url + "/generate", headers=AUTH, timeout=120, json={
                "input_ids": [7, 8, 9, 10, 11], "lora_path": adapter, "routed_dp_rank": dp,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})

        r = requests.post(srv.url + "/load_lora_adapter", headers=AUTH, timeout=120,
                          json={"lora_name": "b", "lora_path": str(b)})
        assert r.status_code == 200 and r.json()["success"], r.text
        r = requests.post(srv.url + "/unload_lora_adapter", headers=AUTH, timeout=120,
                          json={"lora_name": "a"})
        assert r.status_code == 200 and r.json()["success"], r.text
        r = requests.post(srv.url + "/admin/replicas", headers=AUTH, timeout=300)
        assert r.status_code == 200 and r.json()["dp_rank"] == 2, r.text
        want = gen(0, "b")
        assert want.status_code == 200, want.text
        got = gen(2, "b")
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == want.json()["output_ids"]
        assert got.json()["output_ids"] != gen(2, None).json()["output_ids"]  # the adapter acts
        # "a" came with --lora-paths and was unloaded: loading it again succeeds only if every
        # replica, the new one included, has it unloaded (a name already loaded is refused)
        r = requests.post(srv.url + "/load_lora_adapter", headers=AUTH, timeout=120,
                          json={"lora_name": "a", "lora_path": str(a)})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert gen(2, "a").status_code == 200
        assert srv.alive()
    finally:
        srv.stop()

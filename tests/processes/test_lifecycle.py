"""Lifecycle of a real server process tree: crashes and kills bring it down loudly and
completely, Ctrl-C leaves nothing behind, bad launches fail clearly, servers never collide,
multi-node TP works on one machine, and the lockstep check catches diverging ranks."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests

from lockstep.testing.faults import SCHEDULER_METHOD, installed_marker, perturb_env
from lockstep.testing.live_server import LiveServer
from lockstep.utils.process import free_port

pytestmark = pytest.mark.server  # every test here starts server processes

MAX_NEW = 12


def _gen(url: str, text: str, max_new: int = MAX_NEW) -> dict:
    r = requests.post(url + "/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _child_by_title(server: LiveServer, prefix: str) -> int:
    for pid in server.child_pids:
        try:
            if psutil.Process(pid).cmdline()[0].startswith(prefix):
                return pid
        except (psutil.NoSuchProcess, IndexError):
            continue
    raise AssertionError(f"no child titled {prefix!r}")


# A rank other than 0: test_reliability's sigkill[scheduler-other-rank] (dp 2 x tp 2, under load).
@pytest.mark.parametrize("victim", [pytest.param("lockstep::scheduler TP1", marks=pytest.mark.soak),
                                    "lockstep::scheduler TP0", "lockstep::detokenizer"])
def test_sigkill_of_a_child_ends_the_server_nonzero_with_nothing_left(model_dir, tmp_path, victim):
    server = LiveServer("--model-path", model_dir, "--tp-size", "2", log_dir=tmp_path)
    try:
        _gen(server.url, "hello")
        os.kill(_child_by_title(server, victim), signal.SIGKILL)
        server.proc.wait(timeout=10)
        assert server.proc.returncode != 0
        assert _gone(server.child_pids, 10), server.log_tail()
    finally:
        server.stop()


def test_bad_model_path_fails_the_launch_clearly(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.launch_server", "--model-path",
                             str(tmp_path / "no-such-model"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "no-such-model" in out and "Traceback" not in out.split("startup failed")[-1], out[-2000:]
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


def test_two_servers_at_once_both_work_and_front_sigkill_takes_children_with_it(model_dir, tmp_path):
    servers = [LiveServer("--model-path", model_dir, log_dir=tmp_path, wait=False) for _ in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        outs = [_gen(s.url, "two servers") for s in servers]
        assert outs[0]["output_ids"] == outs[1]["output_ids"]
        # Then one of them (no server of its own any more): a SIGKILLed front process takes its
        # children with it.
        server = servers[1]
        assert len(server.child_pids) >= 2
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=10)
        assert _gone(server.child_pids, 10), "children outlived a SIGKILLed front process"
    finally:
        for s in servers:
            s.stop()


def test_sigint_leaves_no_process_and_multi_node_tp2_matches_single_node(model_dir, tmp_path):
    # One single-node TP 2 server for two checks: it answers the reference output, then SIGINT
    # (Ctrl-C) must end it and every child.
    single = LiveServer("--model-path", model_dir, "--tp-size", "2", log_dir=tmp_path)
    try:
        expected = _gen(single.url, "across two nodes")["output_ids"]
        single.proc.send_signal(signal.SIGINT)
        single.proc.wait(timeout=10)
        assert _gone(single.child_pids + [single.proc.pid], 10)
    finally:
        single.stop()
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model-path", model_dir, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1_log = open(tmp_path / "node1.log", "wb")
    node1 = subprocess.Popen([sys.executable, "-m", "lockstep.launch_server", *common,
                              "--node-rank", "1", "--port", str(free_port())],
                             stdout=node1_log, stderr=subprocess.STDOUT)
    try:
        node0 = LiveServer(*common, "--node-rank", "0", log_dir=tmp_path)
        try:
            assert _gen(node0.url, "across two nodes")["output_ids"] == expected
            titles = [c.cmdline()[0] for c in psutil.Process(node1.pid).children(recursive=True)
                      if c.cmdline() and c.cmdline()[0].startswith("lockstep::")]
            assert titles == ["lockstep::scheduler TP1"], "node 1 runs exactly its one scheduler rank"
        finally:
            node0.stop()
        node1.wait(timeout=20)  # its peer is gone: node 1 must not linger
    finally:
        if node1.poll() is None:
            node1.kill()
        node1_log.close()


def test_lockstep_check_passes_under_concurrent_load(model_dir, tmp_path):
    server = LiveServer("--model-path", model_dir, "--tp-size", "2", "--enable-lockstep-check", "1",
                        "--chunked-prefill-size", "16", "--max-total-tokens", "2000", log_dir=tmp_path)
    try:
        texts = [f"request number {i} " * (1 + i % 5) for i in range(24)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda t: _gen(server.url, t, 24), texts))
        assert all(len(o["output_ids"]) == 24 for o in outs)
        assert server.alive()
    finally:
        server.stop()


def test_lockstep_check_catches_a_perturbed_rank(model_dir, tmp_path, monkeypatch):
    for name, value in perturb_env(tmp_path, "scheduler-DP0-TP1-PP0").items():
        monkeypatch.setenv(name, value)
    server = LiveServer("--model-path", model_dir, "--tp-size", "2", "--enable-lockstep-check", "1",
                        log_dir=tmp_path)
    try:  # the fault is in place (else a renamed method would leave the server running)
        assert installed_marker(SCHEDULER_METHOD) in server.log_text(), server.log_tail()
        texts = [f"perturbed {i} " * (1 + i) for i in range(4)]
        def send(text: str) -> None:
            try:  # the server is expected to die under these requests
                requests.post(server.url + "/generate", json={
                    "text": text, "sampling_params": {"max_new_tokens": 8}}, timeout=60)
            except requests.RequestException:
                pass

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(send, texts))
        server.proc.wait(timeout=30)
        assert server.proc.returncode != 0
        log = server.log_text()
        assert "lockstep check failed at step" in log and "fingerprints by rank" in log, log[-3000:]
        assert _gone(server.child_pids, 10)
    finally:
        server.stop()

"""Grammars compile off the scheduler's loop (lockstep.managers.scheduler, "Grammar queue"): a
constrained request waits, not admitted, until its grammar is compiled, while the batch decodes;
the input rank decides when it is ready and every rank admits it at the same step."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from pathlib import Path

import pytest
import requests

from lockstep.testing.live_server import real_model_server

# A large schema: 30 patterned string properties, a 300-value enum, a date-time.
LARGE_SCHEMA = {"type": "object", "required": ["n"], "properties": {
    **{f"field_{i}": {"type": "string", "pattern": r"^[a-z]{3,20}@[a-z]+\.(com|org)$",
                      "maxLength": 40} for i in range(30)},
    "n": {"type": "integer", "minimum": 3, "maximum": 99999},
    "e": {"enum": [f"v{i}" for i in range(300)]}, "d": {"type": "string", "format": "date-time"}}}


def _stream_event_times(url: str, started: threading.Event, times: list[float]) -> None:
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                times.append(time.perf_counter())
                if len(times) == 8:
                    started.set()


@pytest.mark.real_model
def test_first_grammar_and_a_large_schema_do_not_stall_other_streams(tmp_path: Path) -> None:
    """On a fresh server (its first grammar): a background stream's longest gap between events
    stays under a second while a regex and a large JSON schema compile; their outputs hold."""
    with real_model_server(tmp_path) as server:
        times: list[float] = []
        started = threading.Event()
        stream = threading.Thread(target=_stream_event_times, args=(server.url, started, times))
        stream.start()
        assert started.wait(300), "the background stream produced no events"
        window_start = time.perf_counter()

        def constrained(params: dict) -> dict:
            r = requests.post(server.url + "/generate", timeout=600, json={
                "text": "Write it:", "sampling_params": {"max_new_tokens": 64, "temperature": 0,
                                                         **params}})
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            regex = pool.submit(constrained, {"regex": "a{34}"})
            schema = pool.submit(constrained, {"json_schema": json.dumps(LARGE_SCHEMA)})
            regex_out, schema_out = regex.result(), schema.result()
        window_end = time.perf_counter()
        stream.join()
        assert regex_out["text"] == "a" * 34
        assert schema_out["text"].startswith("{")
        during = [b - a for a, b in zip(times, times[1:]) if b >= window_start and a <= window_end]
        assert during, "no stream events while the grammars compiled"
        print(f"longest gap while grammars compiled: {max(during):.3f} s over {len(during)} gaps")
        assert max(during) < 1.0, f"a stream stalled {max(during):.2f} s while grammars compiled"

"""Grammars compile off the scheduler's loop (lockstep.managers.scheduler, "Grammar queue"): a
constrained request waits, not admitted, until its grammar is compiled, while the batch decodes;
the input rank decides when it is ready and every rank admits it at the same step."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from lockstep.constrained.constraint import Constraint
from lockstep.core import FINISH_ABORT
from lockstep.messages import AbortReq, GrammarsReady
from lockstep.testing.inproc import greedy_req, make_scheduler, run_to_completion
from lockstep.testing.live_server import real_model_server

# A large schema: 30 patterned string properties, a 300-value enum, a date-time.
LARGE_SCHEMA = {"type": "object", "required": ["n"], "properties": {
    **{f"field_{i}": {"type": "string", "pattern": r"^[a-z]{3,20}@[a-z]+\.(com|org)$",
                      "maxLength": 40} for i in range(30)},
    "n": {"type": "integer", "minimum": 3, "maximum": 99999},
    "e": {"enum": [f"v{i}" for i in range(300)]}, "d": {"type": "string", "format": "date-time"}}}


REGEX = r"(ab){1,3}x?"


def _slow_compiles(sched: Any, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Each of `sched`'s grammars takes `seconds` longer to compile (on the compile thread)."""
    backend = sched.grammar

    def slow(constraint: Constraint) -> Any:
        time.sleep(seconds)
        return backend.matcher(constraint)

    monkeypatch.setattr(backend, "compile", lambda c: backend._compiler.submit(slow, c))


def test_ranks_admit_a_grammar_at_the_same_step_while_the_batch_decodes(model_dir, monkeypatch) -> None:
    """Two ranks fed the same inputs, one compiling slower: the input rank's GrammarsReady
    admits the constrained request on both at the same step (the slow one blocks there), so
    their batches agree; meanwhile the running request decodes; a constraint that does not
    compile is a 400 naming it."""
    ranks = [make_scheduler(model_dir, debug_fingerprints=True) for _ in range(2)]
    _slow_compiles(ranks[0], monkeypatch, 0.2)
    _slow_compiles(ranks[1], monkeypatch, 0.6)
    timed = {0: [greedy_req("bg", [5, 6, 7, 8], 40)],
             2: [greedy_req("g", [9, 10, 11], 8, constraint=Constraint("regex", REGEX)),
                 greedy_req("bad", [9, 10], 8, constraint=Constraint("regex", "([0-9]"))]}
    outputs: list[dict[str, list[Any]]] = [{}, {}]
    decoded_while_waiting = said_ready = 0
    for step in range(400):
        msgs = ranks[0].collect_inputs(timed.get(step, []))  # the input rank reads readiness
        waiting = len(ranks[0].grammar_queue)
        for rank, out in zip(ranks, outputs):
            for o in rank.run_step(msgs):
                out.setdefault(o.rid, []).append(o)
        assert len(ranks[1].grammar_queue) == len(ranks[0].grammar_queue)
        if waiting and any(o.rid == "bg" and o.new_token_ids for o in outputs[0].get("bg", [])[-1:]):
            decoded_while_waiting += 1
        said_ready += sum(isinstance(m, GrammarsReady) for m in msgs)
        if step > 2 and all(r.is_idle() for r in ranks):
            break
    assert all(r.is_idle() for r in ranks) and said_ready
    assert ranks[0].fingerprints == ranks[1].fingerprints
    assert decoded_while_waiting > 0, "the running request stopped while the grammar compiled"
    for rank, out in zip(ranks, outputs):
        rank.check_integrity()
        text = rank.tokenizer.decode([t for o in out["g"] for t in o.new_token_ids],
                                     skip_special_tokens=True)
        assert re.fullmatch(REGEX, text), text
        bad = out["bad"][-1].finish_reason
        assert isinstance(bad, FINISH_ABORT) and bad.status_code == 400 and "regex" in bad.message
    assert [len(o) for o in outputs[0].values()] == [len(o) for o in outputs[1].values()]


def test_a_request_aborted_while_its_grammar_compiles_ends_cleanly(model_dir, monkeypatch) -> None:
    sched = make_scheduler(model_dir)
    _slow_compiles(sched, monkeypatch, 0.3)
    done = run_to_completion(sched, {
        0: [greedy_req("g", [9, 10, 11], 8, constraint=Constraint("regex", REGEX))],
        1: [AbortReq("g")]})
    assert isinstance(done["g"].finish_reason, FINISH_ABORT) and not done["g"].output_ids
    assert not sched.grammar_queue  # run_to_completion checked the KV at idle


def _stream_event_times(url: str, started: threading.Event, times: list[float]) -> None:
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                times.append(time.perf_counter())
                if len(times) == 16:
                    started.set()


@pytest.mark.server
@pytest.mark.real_model
def test_first_grammar_and_a_large_schema_do_not_stall_other_streams(tmp_path: Path) -> None:
    """On a fresh server (its first grammar): a background stream's longest gap between events
    stays under a second (beyond its own pace) while a regex and a large JSON schema compile;
    their outputs hold."""
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
        before = [b - a for a, b in zip(times, times[1:]) if b < window_start]
        print(f"longest gap while grammars compiled: {max(during):.3f} s over {len(during)} gaps "
              f"(before them: {max(before):.3f} s over {len(before)})")
        # On top of the stream's own slowest step before them (a machine busy with other work
        # is slow without any grammar): at most a second. The stall this guards against was the
        # vocabulary and the compile on the loop, seconds long.
        bound = 1.0 + max(before)
        assert max(during) < bound, f"a stream stalled {max(during):.2f} s while grammars compiled"

"""Load-budget dispatch (SGLang's total_requests / total_tokens): the DP controller counts what
the replicas report plus what it sent that a report has not seen yet; and routed_dp_rank /
data_parallel_rank pin a request to a replica, against a live DP 2 server."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import requests

from lockstep.managers.data_parallel_controller import Dispatcher
from lockstep.messages import LoadReport, TokenizedGenerateReq
from lockstep.sampling_params import SamplingParams
from lockstep.testing.live_server import LiveServer


def _req(rid: str, n: int, pin: int | None = None) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid, list(range(1, n + 1)), SamplingParams(), routed_dp_rank=pin)


def test_total_tokens_counts_reported_backlog_and_unseen_dispatches():
    d = Dispatcher("total_tokens", 2)
    # Replica 0 reports a 2,048-token prompt still to prefill; replica 1 holds more KV in use (a
    # long request decoding) but has nothing left to compute: a new request waits less there.
    d.report(LoadReport(0, running=1, queued=1, tokens_in_use=100, queued_tokens=2048))
    d.report(LoadReport(1, running=3, queued=0, tokens_in_use=2900, queued_tokens=0))
    assert [d.choose(_req(f"s{i}", 100)) for i in range(3)] == [1, 1, 1]
    # 3 x 100 sent to replica 1 and not yet seen: a backlog of 300 < 2,048, still replica 1; a
    # long one tips it over.
    assert d.choose(_req("long", 2048)) == 1
    assert d.choose(_req("next", 10)) == 0
    # Replica 1's report has seen 2 of its 4 (and computed them): the other two still count.
    d.report(LoadReport(1, running=5, queued=0, tokens_in_use=3100, queued_tokens=0, received=2))
    assert list(d.replicas[1].unseen) == [100, 2048]
    assert d.replicas[1].backlog == 2148
    # Equal backlogs: the one with less KV in use.
    d.report(LoadReport(0, running=1, queued=0, tokens_in_use=100, queued_tokens=2148, received=1))
    assert d.choose(_req("tie", 0)) == 0


def test_total_requests_is_the_queue_the_replicas_report():
    d = Dispatcher("total_requests", 3)
    for rank, (run, queued) in enumerate([(4, 2), (1, 0), (2, 2)]):
        d.report(LoadReport(rank, running=run, queued=queued, tokens_in_use=0))
    # Loads 6, 1, 4: replica 1 until its unseen dispatches bring it level with replica 2.
    picks = [d.choose(_req(f"r{i}", 8)) for i in range(5)]
    assert picks == [1, 1, 1, 1, 2], picks


@pytest.mark.parametrize("method", ["round_robin", "total_tokens", "cache_aware"])
def test_a_pinned_request_goes_where_it_says_whatever_the_method(method):
    d = Dispatcher(method, 2)
    d.report(LoadReport(1, running=50, queued=50, tokens_in_use=5000, queued_tokens=5000))
    assert [d.choose(_req(f"p{i}", 16, pin=1)) for i in range(4)] == [1] * 4


@pytest.mark.server
def test_routed_dp_rank_pins_on_a_live_dp2_server(model_dir: Path, tmp_path: Path) -> None:
    srv = LiveServer("--model-path", str(model_dir), "--dp-size", "2", "--max-total-tokens", "2048",
                     "--load-balance-method", "total_tokens", log_dir=tmp_path, startup_timeout=180)
    try:
        def post(**extra):
            return requests.post(srv.url + "/generate", json={
                "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2}, **extra},
                timeout=60)

        def gen(**extra):
            r = post(**extra)
            assert r.status_code == 200, r.text
            return r.json()

        for pin, name in ((1, "routed_dp_rank"), (0, "data_parallel_rank"), (1, "data_parallel_rank")):
            ranks = Counter(gen(**{name: pin})["meta_info"]["dp_rank"] for _ in range(4))
            assert ranks == {pin: 4}, (name, ranks)
        # A session's next turn runs where the turn it continues ran (its KV is there).
        sid = requests.post(srv.url + "/open_session", json={"capacity_of_str_len": 1000}).json()
        one = gen(routed_dp_rank=1, session_params={"id": sid}, input_ids=list(range(10, 90)))
        two = gen(session_params={"id": sid, "rid": one["meta_info"]["id"]})
        assert one["meta_info"]["dp_rank"] == two["meta_info"]["dp_rank"] == 1
        assert two["meta_info"]["cached_tokens"] >= 80
        r = requests.post(srv.url + "/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": 2, "routed_dp_rank": 1}, timeout=60)
        assert r.status_code == 200, r.text
        for bad in ({"routed_dp_rank": 2}, {"routed_dp_rank": -1},
                    {"routed_dp_rank": 0, "data_parallel_rank": 1}):
            r = post(**bad)
            assert r.status_code == 400 and "rank" in r.text, (bad, r.text)
        assert srv.alive()
    finally:
        srv.stop()

"""SGLang's sessions: /open_session, /close_session and a /generate request's session_params,
against the session's live tiny-model server: a continued turn gives the output of sending the
whole conversation and reuses the earlier turn's KV (cached_tokens), and every bound is a 4xx.
The tree of turns (replace, offset, drop_previous_output) is checked on the controller itself."""

from __future__ import annotations

import random
import time

import pytest
import requests

from lockstep.entrypoints.session_controller import SessionController, SessionError
from lockstep.messages import SessionParams
from lockstep.testing.live_server import API_KEY, LiveServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def post(llama_server: LiveServer):
    def post(path: str, body: dict) -> requests.Response:
        return requests.post(llama_server.url + path, json=body, headers=AUTH, timeout=120)
    return post


def _gen(post, ids: list[int], **extra) -> dict:
    r = post("/generate", {"input_ids": ids, "sampling_params": GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.server
def test_a_continued_turn_equals_the_whole_conversation_and_reuses_its_kv(post):
    sid = post("/open_session", {"capacity_of_str_len": 4096}).json()
    assert isinstance(sid, str) and sid
    first, second, third = _ids(300, 1), _ids(20, 2), _ids(12, 3)
    one = _gen(post, first, session_params={"id": sid})
    two = _gen(post, second, session_params={"id": sid, "rid": one["meta_info"]["id"]})
    history = first + one["output_ids"]
    # Only the new turn was computed: the earlier prompt and output came from the cache (all
    # but the last output token, which was sampled and never fed back).
    assert two["meta_info"]["prompt_tokens"] == len(history) + len(second)
    assert two["meta_info"]["cached_tokens"] >= len(history) - 1
    assert _gen(post, history + second)["output_ids"] == two["output_ids"]
    # A third turn on the second; then a branch off the first that leaves its output out.
    three = _gen(post, third, session_params={"id": sid, "rid": two["meta_info"]["id"]})
    whole = history + second + two["output_ids"] + third
    assert _gen(post, whole)["output_ids"] == three["output_ids"]
    branch = _gen(post, third, session_params={"id": sid, "rid": one["meta_info"]["id"],
                                                "drop_previous_output": True})
    assert branch["meta_info"]["prompt_tokens"] == len(first) + len(third)
    assert _gen(post, first + third)["output_ids"] == branch["output_ids"]
    assert post("/close_session", {"session_id": sid}).status_code == 200


@pytest.mark.server
def test_session_bounds_and_mistakes_are_4xx(post, llama_server: LiveServer):
    small = post("/open_session", {"capacity_of_str_len": 40, "session_id": "small"}).json()
    assert small == "small"
    r = post("/open_session", {"capacity_of_str_len": 40, "session_id": "small"})
    assert r.status_code == 400 and "already open" in r.text
    one = _gen(post, _ids(30, 4), session_params={"id": "small"})
    r = post("/generate", {"input_ids": _ids(5, 5), "sampling_params": GREEDY,
                           "session_params": {"id": "small", "rid": one["meta_info"]["id"]}})
    assert r.status_code == 400 and "capacity_of_str_len" in r.text, r.text
    for params, status, words in (({"id": "nope"}, 404, "no open session"),
                                  ({"id": "small", "rid": "nope"}, 404, "no finished request")):
        r = post("/generate", {"input_ids": [7, 8], "sampling_params": GREEDY,
                               "session_params": params})
        assert r.status_code == status and words in r.text, r.text
    r = post("/generate", {"input_ids": [[7, 8], [9]], "session_params": {"id": "small"}})
    assert r.status_code == 400 and "one prompt" in r.text
    r = post("/open_session", {"capacity_of_str_len": 40, "streaming": True})
    assert r.status_code == 400 and "streaming" in r.text
    assert post("/close_session", {"session_id": "small"}).status_code == 200
    assert post("/close_session", {"session_id": "small"}).status_code == 404
    r = post("/generate", {"input_ids": [7], "sampling_params": GREEDY,
                           "session_params": {"id": "small"}})
    assert r.status_code == 404
    brief = post("/open_session", {"capacity_of_str_len": 100, "timeout": 0.5}).json()
    time.sleep(1.0)
    r = post("/generate", {"input_ids": [7], "sampling_params": GREEDY,
                           "session_params": {"id": brief}})
    assert r.status_code == 404 and "no open session" in r.text
    assert llama_server.alive()


def test_replace_offset_and_the_tree_of_turns():
    c = SessionController()
    sid = c.open(1000, None, None)

    def turn(name: str, ids: list[int], out: list[int], **params) -> list[int]:
        cont = c.begin(SessionParams(sid, **params), ids, bos_token_id=1)
        c.end(cont, name, out, dp_rank=1)
        return cont.input_ids

    assert turn("a", [1, 10, 11], [12, 13]) == [1, 10, 11]
    assert turn("b", [1, 20], [21], rid="a") == [1, 10, 11, 12, 13, 20]  # BOS of a turn dropped
    assert turn("c", [30], [31], rid="b", offset=3) == [1, 10, 11, 30]
    assert c.begin(SessionParams(sid, rid="a"), [5], None).dp_rank == 1  # where a's KV is
    c.end(c.begin(SessionParams(sid, rid="a"), [5], None), "gone", None, None)  # failed: not kept
    assert set(c.sessions[sid].turns) == {"a", "b", "c"}
    # replace from a: b and c (after a) are dropped; a stays.
    assert turn("d", [40], [41], rid="a", replace=True) == [1, 10, 11, 12, 13, 40]
    assert set(c.sessions[sid].turns) == {"a", "d"}
    # A turn whose parent was replaced while it ran is not kept.
    cont = c.begin(SessionParams(sid, rid="d"), [50], None)
    turn("e", [60], [61], replace=True)  # without a rid: every turn goes
    c.end(cont, "late", [51], None)
    assert set(c.sessions[sid].turns) == {"e"}
    with pytest.raises(SessionError, match="no finished request"):
        c.begin(SessionParams(sid, rid="late"), [1], None)

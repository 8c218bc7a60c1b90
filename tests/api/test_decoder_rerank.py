"""A yes/no reranker (Qwen3-Reranker) through a live server: a tiny random-weight Qwen3 named as
one, its /v1/rerank (SGLang's, with and without `instruct`), /rerank and /v2/rerank scores against
transformers' p(yes) of the model card's prompt (lockstep.testing.reranker_oracle), the same order,
and a document's score the same alone and among others."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from lockstep.testing.live_server import LiveServer
from lockstep.testing.reranker_oracle import transformers_p_yes
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_models import make_tiny_yes_no_reranker

QUERY = "which animal eats bamboo?"
DOCS = ["Paris is the capital of France.", "The giant panda eats bamboo.", "hi",
        "A compiler translates source code into machine code."]
INSTRUCT = "Given a question about animals, find the passage that answers it"


@pytest.fixture(scope="module")
@marks("server")
def yes_no_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer("--model-path", str(make_tiny_yes_no_reranker()),
                     log_dir=tmp_path_factory.mktemp("yes-no-server"), startup_timeout=180)
    yield srv
    srv.stop_cleanly()


def _post(srv: LiveServer, path: str, body: dict) -> requests.Response:
    return requests.post(srv.url + path, json=body, timeout=60)


def _order(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])


@pytest.mark.parametrize("instruct", [None, INSTRUCT])
def test_sglang_rerank_is_transformers_p_yes(yes_no_server: LiveServer, instruct: str | None) -> None:
    ref = transformers_p_yes(make_tiny_yes_no_reranker(), QUERY, DOCS, instruct)
    body = {"query": QUERY, "documents": DOCS, **({"instruct": instruct} if instruct else {})}
    r = _post(yes_no_server, "/v1/rerank", body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [g["index"] for g in got] == _order(ref)
    for g in got:
        assert abs(g["score"] - ref[g["index"]]) < 2e-6 and g["document"] == DOCS[g["index"]]


def test_the_instruction_changes_the_scores(yes_no_server: LiveServer) -> None:
    plain = _post(yes_no_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    told = _post(yes_no_server, "/v1/rerank",
                 {"query": QUERY, "documents": DOCS, "instruct": INSTRUCT}).json()
    assert {g["index"]: g["score"] for g in plain} != {g["index"]: g["score"] for g in told}


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_jina_cohere_rerank_is_transformers_p_yes(yes_no_server: LiveServer, path: str) -> None:
    ref = transformers_p_yes(make_tiny_yes_no_reranker(), QUERY, DOCS)
    body = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 3}
    got = _post(yes_no_server, path, body).json()
    assert [x["index"] for x in got["results"]] == _order(ref)[:3]
    for x in got["results"]:
        assert abs(x["relevance_score"] - ref[x["index"]]) < 2e-6
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert got["usage"]["prompt_tokens"] > len(DOCS) * 40  # each pair in the full prompt


def test_a_score_is_the_same_alone_and_among_others(yes_no_server: LiveServer) -> None:
    together = {g["index"]: g["score"] for g in
                _post(yes_no_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()}
    for i, doc in enumerate(DOCS):
        alone = _post(yes_no_server, "/v1/rerank", {"query": QUERY, "documents": [doc]}).json()
        assert alone[0]["score"] == together[i]
    assert requests.get(yes_no_server.url + "/health_generate", timeout=60).status_code == 200

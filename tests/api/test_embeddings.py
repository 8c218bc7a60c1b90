"""The embedding and rerank routes against live servers: all-MiniLM-L6-v2 from its wheel through
the official openai client and every input form of /v1/embeddings and /encode (values against
sentence-transformers), a tiny cross-encoder through /v1/rerank, /rerank and /v2/rerank (scores
against transformers), and the 400s of a route the server's model does not serve."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from lockstep.model_loader import resolve_model
from lockstep.testing.live_server import API_KEY, LiveServer
from lockstep.testing.tiers import marks
from lockstep.testing.tiny_encoders import make_tiny_encoder, tiny_hf_encoder

MINILM = "all-minilm-l6-v2"
TEXTS = ["A man is eating food.", "The giant panda lives in the bamboo forests of China.",
         "hello", "Rain is expected over the weekend, with storms on Sunday evening and a cold "
                  "wind from the north that will last until Tuesday morning."]
QUERY = "which animal eats bamboo?"
DOCS = ["Paris is the capital of France.", "The giant panda eats bamboo.", "hi",
        "A compiler translates source code into machine code."]


@pytest.fixture(scope="module")
@marks("server", "real_model")
def minilm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer("--model-path", MINILM, log_dir=tmp_path_factory.mktemp("minilm-server"),
                     startup_timeout=180)
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
@marks("server")
def rerank_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer("--model-path", str(make_tiny_encoder("rerank")),
                     log_dir=tmp_path_factory.mktemp("rerank-server"), startup_timeout=180)
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def st_vectors() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(resolve_model(MINILM).model_dir), device="cpu")
    return st.encode(TEXTS, convert_to_tensor=True)


def _post(srv: LiveServer, path: str, body: dict, **kw) -> requests.Response:  # noqa: ANN003
    return requests.post(srv.url + path, json=body, timeout=60, **kw)


def _vectors(reply: dict) -> torch.Tensor:
    return torch.tensor([d["embedding"] for d in sorted(reply["data"], key=lambda d: d["index"])])


def test_openai_client_gets_sentence_transformers_vectors(minilm_server: LiveServer,
                                                          st_vectors: torch.Tensor) -> None:
    """The official client, unchanged (it asks for base64 and decodes it itself)."""
    import openai

    client = openai.OpenAI(base_url=minilm_server.url + "/v1", api_key="unused")
    got = client.embeddings.create(model=MINILM, input=TEXTS)
    ours = torch.tensor([d.embedding for d in got.data])
    assert ours.shape == (len(TEXTS), 384)
    assert (ours - st_vectors).abs().max().item() < 1e-5
    tok = _tokenizer()
    assert got.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in TEXTS)


def _tokenizer():  # noqa: ANN202
    from lockstep.testing.inproc import packaged_tokenizer

    return packaged_tokenizer(MINILM)


def test_every_input_form_gives_the_same_vectors(minilm_server: LiveServer,
                                                 st_vectors: torch.Tensor) -> None:
    ids = [_tokenizer()(t).input_ids for t in TEXTS]
    strings = _vectors(_post(minilm_server, "/v1/embeddings", {"input": TEXTS}).json())
    one = _vectors(_post(minilm_server, "/v1/embeddings", {"input": TEXTS[1]}).json())
    id_list = _vectors(_post(minilm_server, "/v1/embeddings", {"input": ids[1]}).json())
    id_lists = _vectors(_post(minilm_server, "/v1/embeddings", {"input": ids}).json())
    assert (strings - st_vectors).abs().max().item() < 1e-5
    assert torch.equal(strings, id_lists)
    assert torch.equal(one[0], strings[1]) and torch.equal(id_list[0], strings[1])


def test_base64_is_the_float32_bytes_of_the_float_reply(minilm_server: LiveServer) -> None:
    floats = _post(minilm_server, "/v1/embeddings", {"input": TEXTS[:2]}).json()
    b64 = _post(minilm_server, "/v1/embeddings",
                {"input": TEXTS[:2], "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"], strict=True):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]
    assert floats["usage"] == b64["usage"] and floats["model"] == MINILM


def test_encode_route_gives_the_same_vectors(minilm_server: LiveServer) -> None:
    ref = _vectors(_post(minilm_server, "/v1/embeddings", {"input": TEXTS}).json())
    single = _post(minilm_server, "/encode", {"text": TEXTS[0]}).json()
    batch = _post(minilm_server, "/encode", {"text": TEXTS}).json()
    by_ids = _post(minilm_server, "/encode", {"input_ids": [_tokenizer()(TEXTS[2]).input_ids]}).json()
    assert single["embedding"] == ref[0].tolist()
    assert single["meta_info"]["prompt_tokens"] == len(_tokenizer()(TEXTS[0]).input_ids)
    assert [b["embedding"] for b in batch] == ref.tolist() and [b["index"] for b in batch] == [0, 1, 2, 3]
    assert by_ids[0]["embedding"] == ref[2].tolist()


@pytest.mark.parametrize(("body", "says"), [
    ({"input": "x", "dimensions": 64}, "matryoshka"),
    ({"input": []}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "temperature": 0.5}, "temperature"),
    ({"input": "word " * 600}, "context"),
    ({"input": [[1, 2, 999999]]}, "outside the vocabulary"),
])
def test_bad_embedding_requests_are_400s(minilm_server: LiveServer, body: dict, says: str) -> None:
    r = _post(minilm_server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert _post(minilm_server, "/v1/embeddings", {"input": "still serving"}).status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/generate", {"text": "hi"}),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ("/v2/rerank", {"query": "q", "documents": ["d"]}),
])
def test_an_embedding_server_refuses_other_routes(minilm_server: LiveServer, path: str, body: dict) -> None:
    r = _post(minilm_server, path, body)
    assert r.status_code == 400, r.text
    assert "serves embeddings" in r.json()["error"]["message"]
    assert requests.get(minilm_server.url + "/health_generate", timeout=60).status_code == 200


def _hf_relevance() -> list[float]:
    from transformers import AutoTokenizer

    path = make_tiny_encoder("rerank")
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = tiny_hf_encoder("rerank")
    with torch.no_grad():
        logits = [hf(**{k: torch.tensor([v]) for k, v in tok(QUERY, d).items()}).logits[0, 0].item()
                  for d in DOCS]
    return [1 / (1 + math.exp(-x)) for x in logits]


def test_sglang_rerank_scores_and_orders_as_transformers(rerank_server: LiveServer) -> None:
    ref = _hf_relevance()
    got = _post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    assert [g["index"] for g in got] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    for g in got:
        assert abs(g["score"] - ref[g["index"]]) < 1e-5 and g["document"] == DOCS[g["index"]]
    top = _post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                              "return_documents": False}).json()
    assert [t["index"] for t in top] == [g["index"] for g in got[:2]]
    assert all("document" not in t for t in top)


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_jina_cohere_rerank_shape(rerank_server: LiveServer, path: str) -> None:
    ref = _hf_relevance()
    body = {"model": "any", "query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 3}
    r = _post(rerank_server, path, body)
    assert r.status_code == 404  # a model this server does not serve
    body["model"] = str(make_tiny_encoder("rerank"))
    got = _post(rerank_server, path, body).json()
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:3]
    assert [x["index"] for x in got["results"]] == order
    for x in got["results"]:
        assert abs(x["relevance_score"] - ref[x["index"]]) < 1e-5
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert got["usage"]["prompt_tokens"] > len(DOCS) * 5


def test_a_cross_encoder_takes_no_instruction(rerank_server: LiveServer) -> None:
    """`instruct` is a yes/no reranker's (tests/api/test_decoder_rerank.py); not ignored here."""
    r = _post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "instruct": "x"})
    assert r.status_code == 400 and "instruct" in r.json()["error"]["message"], r.text


def test_a_reranker_refuses_embeddings_and_generation(rerank_server: LiveServer) -> None:
    for path, body in [("/v1/embeddings", {"input": "x"}), ("/generate", {"text": "hi"})]:
        r = _post(rerank_server, path, body)
        assert r.status_code == 400 and "scores (rerank)" in r.json()["error"]["message"], r.text


def test_a_generation_server_refuses_embeddings(llama_server: LiveServer) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in [("/v1/embeddings", {"input": "x"}), ("/encode", {"text": "x"}),
                       ("/v1/rerank", {"query": "q", "documents": ["d"]})]:
        r = _post(llama_server, path, body, headers=auth)
        assert r.status_code == 400 and "generates text" in r.json()["error"]["message"], r.text


def test_packaged_embedding_model_is_listed() -> None:
    from lockstep.model_loader.packaged import PACKAGED_MODELS

    m = PACKAGED_MODELS[MINILM]
    assert m.kind == "embed" and (Path(m.path()) / "modules.json").is_file()


@pytest.mark.server
@pytest.mark.parametrize("flags", [("--tp-size", "2"), ("--dp-size", "2")])
def test_tp2_and_dp2_give_the_bits_of_one_rank(flags: tuple[str, str], tmp_path: Path) -> None:
    """Mixed-length texts through a TP 2 / DP 2 server of the tiny mean-pooling BERT: each vector
    bitwise the in-process TP 1 scheduler's."""
    from transformers import AutoTokenizer

    from lockstep.testing.embedding_oracle import embed_in_process, sentences
    from lockstep.testing.inproc import make_scheduler

    path = make_tiny_encoder("embed-mean")
    texts = sentences(24, seed=11, lines=4)
    tok = AutoTokenizer.from_pretrained(str(path))
    ref = embed_in_process(make_scheduler(path), [tok(t).input_ids for t in texts])
    srv = LiveServer("--model-path", str(path), *flags, log_dir=tmp_path, startup_timeout=240)
    try:
        got = _post(srv, "/encode", {"text": texts}).json()
    finally:
        srv.stop_cleanly()
    assert [g["embedding"] for g in got] == ref


@pytest.mark.server
def test_a_bert_gguf_serves_the_vectors_of_its_hf_directory(tmp_path: Path) -> None:
    """A tiny mean-pooling BERT's GGUF, as llama.cpp's converter writes it, served by its path
    alone (the kind and pooling read from the GGUF): /v1/embeddings gives bitwise the in-process
    vectors of the HF directory it came from, and counts the HF tokenizer's ids."""
    from transformers import AutoTokenizer

    from lockstep.testing.embedding_oracle import embed_in_process
    from lockstep.testing.gguf_writer import write_bert_gguf
    from lockstep.testing.inproc import make_scheduler

    hf_dir = make_tiny_encoder("embed-mean")
    path = write_bert_gguf(hf_dir, tmp_path / "tiny-bert.gguf")
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = [tok(t).input_ids for t in TEXTS]
    ref = embed_in_process(make_scheduler(hf_dir), ids)
    srv = LiveServer("--model-path", str(path), log_dir=tmp_path, startup_timeout=180)
    try:
        reply = _post(srv, "/v1/embeddings", {"model": str(path), "input": TEXTS}).json()
    finally:
        srv.stop_cleanly()
    assert _vectors(reply).tolist() == ref
    assert reply["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_sglang_score_gives_transformers_label_probabilities(llama_server: LiveServer,
                                                             model_dir: Path) -> None:
    """/v1/score on a generation server: per item, the probability of each label token right after
    query + item (softmaxed over the labels with apply_softmax), as transformers gives it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    query, items, labels = "The river bends twice", [" before it reaches", " and the town"], [5, 17, 40]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"query": query, "items": items, "label_token_ids": labels}
    plain = _post(llama_server, "/v1/score", body, headers=auth).json()
    soft = _post(llama_server, "/v1/score", {**body, "apply_softmax": True}, headers=auth).json()
    for i, item in enumerate(items):
        with torch.no_grad():
            logits = hf(torch.tensor([tok(query + item).input_ids])).logits[0, -1]
        probs = torch.softmax(logits.double(), -1)[labels]
        assert torch.allclose(torch.tensor(plain["scores"][i]).double(), probs, rtol=1e-4, atol=1e-7)
        assert torch.allclose(torch.tensor(soft["scores"][i]).double(), probs / probs.sum(), rtol=1e-4)
    assert plain["object"] == "scoring" and plain["usage"]["prompt_tokens"] > 0
    bad = _post(llama_server, "/v1/score", {**body, "items": [[1, 2]]}, headers=auth)
    assert bad.status_code == 400 and "not both" in bad.json()["error"]["message"]


def test_an_embedding_server_refuses_score(minilm_server: LiveServer) -> None:
    r = _post(minilm_server, "/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1]})
    assert r.status_code == 400 and "serves embeddings" in r.json()["error"]["message"]


LANGCHAIN_PROGRAM = r'''
import json, sys
from langchain_openai import OpenAIEmbeddings

# check_embedding_ctx_length=False: LangChain otherwise cuts the text into OpenAI's own (tiktoken)
# token ids, which mean nothing to another model's vocabulary (its docs say so for other servers)
emb = OpenAIEmbeddings(base_url=sys.argv[1] + "/v1", api_key="none", model="all-minilm-l6-v2",
                       check_embedding_ctx_length=False)
print(json.dumps({"docs": emb.embed_documents(json.loads(TEXTS_JSON)), "query": emb.embed_query("hello")}))
'''


def _client_gets_the_vectors(server: LiveServer, st_vectors: torch.Tensor, packages: list[str],
                             program: str, venvs: Path, tmp_path: Path) -> None:
    """A client framework in its own venv embeds TEXTS and a query through the live server: the
    documents are sentence-transformers' vectors, the query the server's own."""
    from lockstep.testing.client_venv import PackageIndexUnreachable, client_venv, run_client

    try:
        python = client_venv(venvs, packages)
    except PackageIndexUnreachable as e:
        pytest.skip(str(e))
    out = run_client(python, program.replace("TEXTS_JSON", repr(json.dumps(TEXTS))), server.url, tmp_path)
    assert (torch.tensor(out["docs"]) - st_vectors).abs().max().item() < 1e-5
    ref = _vectors(_post(server, "/v1/embeddings", {"input": "hello"}).json())[0]
    assert (torch.tensor(out["query"]) - ref).abs().max().item() < 1e-6


def test_langchain_openai_embeddings(minilm_server: LiveServer, st_vectors: torch.Tensor,
                                     tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    _client_gets_the_vectors(minilm_server, st_vectors, ["langchain-openai==1.7.4"], LANGCHAIN_PROGRAM,
                             tmp_path_factory.getbasetemp().parent, tmp_path)


LLAMA_INDEX_PROGRAM = r'''
import json, sys
from llama_index.embeddings.openai_like import OpenAILikeEmbedding

emb = OpenAILikeEmbedding(model_name="all-minilm-l6-v2", api_base=sys.argv[1] + "/v1", api_key="none")
print(json.dumps({"docs": emb.get_text_embedding_batch(json.loads(TEXTS_JSON)),
                  "query": emb.get_query_embedding("hello")}))
'''


def test_llama_index_openai_like_embedding(minilm_server: LiveServer, st_vectors: torch.Tensor,
                                           tmp_path_factory: pytest.TempPathFactory,
                                           tmp_path: Path) -> None:
    """llama-index's OpenAILikeEmbedding, unchanged (no option needed: it sends the texts)."""
    _client_gets_the_vectors(minilm_server, st_vectors, ["llama-index-embeddings-openai-like==0.4.0"],
                             LLAMA_INDEX_PROGRAM, tmp_path_factory.getbasetemp().parent, tmp_path)

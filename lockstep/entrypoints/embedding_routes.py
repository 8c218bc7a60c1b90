"""The embedding and rerank routes: OpenAI's /v1/embeddings, SGLang's /encode and /v1/rerank,
Jina's / Cohere's /rerank and /v2/rerank, and SGLang's /v1/score (a generative model's label-token
probabilities, from the prompt logprob of each label appended to query + item). Each input is one prefill-only request (max_new_tokens
0) through the same TokenizerManager, scheduler and model runner as generation; the model's
pooling step (lockstep.managers.pooling_step) sends back its vector, or for a reranker its
scores, instead of a token. A server whose model does not serve the route's kind answers 400
(TokenizerManager.check_kind): embeddings need an embedding model, rerank a reranker (a
cross-encoder, or a decoder that answers yes or no: Qwen3-Reranker)."""

from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from lockstep.entrypoints.app_state import AppState, State, returns
from lockstep.entrypoints.fanout import run_to_completion
from lockstep.entrypoints.middleware import JSONRoute
from lockstep.entrypoints.openai.chat_templates import reranker_prompt
from lockstep.entrypoints.openai.embedding_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EncodeRequest,
    EncodeResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    SGLangRerankResult,
)
from lockstep.entrypoints.tokenizer_manager import GenerateOutput, RequestError
from lockstep.messages import TokenizedGenerateReq
from lockstep.sampling_params import SamplingParams
from lockstep.utils.http import json_response

router = APIRouter(route_class=JSONRoute)


async def _pooled(state: AppState, prompts: list[tuple[str | None, list[int] | None]],
                  request: Request, rids: list[str] | None = None) -> list[GenerateOutput]:
    """Each (text, ids) as a prefill-only request; their outputs in order, each with .embedding."""
    if len(prompts) > state.args.max_batch_size:
        raise RequestError(f"{len(prompts)} inputs; this server takes at most "
                           f"{state.args.max_batch_size} per request (--max-batch-size)")
    singles = [TokenizedGenerateReq(rids[i] if rids else "", None if ids is None else
                                    state.tm.check_ids(ids, "input"),
                                    SamplingParams(max_new_tokens=0), input_text=text, prompt_index=i)
               for i, (text, ids) in enumerate(prompts)]
    return await run_to_completion(state.tm, singles, request)


def _truncated(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, normalized again (Matryoshka models)."""
    if dimensions is None:
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def _check_dimensions(state: AppState, dimensions: int | None) -> None:
    if dimensions is None:
        return
    supported = (state.launched.info.get("pooling") or {}).get("dimensions")
    if not supported:
        raise RequestError("dimensions: this server's model was not trained to be truncated "
                           "(its config.json has no matryoshka_dimensions); leave dimensions out")
    if dimensions not in supported:
        raise RequestError(f"dimensions: {dimensions} is not one of the model's "
                           f"matryoshka_dimensions {list(supported)}")


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings", responses=returns(EmbeddingResponse))
async def embeddings(req: EmbeddingRequest, request: Request, state: State) -> Response:
    state.tm.check_kind("embed", "/v1/embeddings")
    state.openai.check_model(req.model)
    _check_dimensions(state, req.dimensions)
    outs = await _pooled(state, req.prompts(), request)
    data = []
    for i, out in enumerate(outs):
        vector = _truncated(out.embedding or [], req.dimensions)
        data.append({"object": "embedding", "index": i,
                     "embedding": _base64(vector) if req.encoding_format == "base64" else vector})
    used = sum(o.prompt_tokens for o in outs)
    return json_response({"object": "list", "data": data, "model": state.openai.model_name,
                          "usage": {"prompt_tokens": used, "total_tokens": used}})


@router.post("/encode", responses=returns(EncodeResponse | list[EncodeResponse]))
async def encode(req: EncodeRequest, request: Request, state: State) -> Response:
    state.tm.check_kind("embed", "/encode")
    try:
        many, prompts = req.prompts()
    except ValueError as e:
        raise RequestError(str(e)) from e
    rids = [req.rid] if isinstance(req.rid, str) else req.rid
    if rids is not None and len(rids) != len(prompts):
        raise RequestError(f"rid: {len(rids)} rids for {len(prompts)} inputs")
    outs = await _pooled(state, prompts, request, rids)
    items = [{"embedding": o.embedding, "meta_info": o.meta_info(), **({"index": i} if many else {})}
             for i, o in enumerate(outs)]
    return json_response(items if many else items[0])


async def _rerank(state: AppState, req: RerankRequest, request: Request, route: str
                  ) -> tuple[list[tuple[int, float]], list[GenerateOutput]]:
    """(document index, relevance) best first, cut to top_n; and the outputs in document order.
    A cross-encoder reads each (query, document) pair as the tokenizer encodes a pair (with its
    segments); a yes/no reranker reads it in its prompt, with the request's instruction."""
    state.tm.check_kind("score", route)
    state.openai.check_model(req.model)
    pairs: list[tuple[str | None, list[int] | None]]
    if (state.launched.info.get("pooling") or {}).get("label_tokens"):
        pairs = [(reranker_prompt(req.query, doc, req.instruct), None) for doc in req.texts()]
    elif req.instruct is not None:
        raise RequestError("instruct: this server's model is a cross-encoder, which takes no "
                           "instruction (a yes/no reranker such as Qwen3-Reranker does)")
    else:
        tok = state.tm.tokenizer
        pairs = [(None, tok(req.query, doc).input_ids) for doc in req.texts()]
    outs = await _pooled(state, pairs, request)
    scored = sorted(((i, _relevance(o.embedding or [])) for i, o in enumerate(outs)),
                    key=lambda p: (-p[1], p[0]))
    return scored[: req.top_n] if req.top_n else scored, outs


def _relevance(scores: list[float]) -> float:
    """A cross-encoder's logits as a relevance in [0, 1]: the sigmoid of a single logit (as
    sentence-transformers' CrossEncoder gives it), else the probability of the last label (a
    yes/no reranker's labels are no, yes: p(yes))."""
    if len(scores) == 1:
        return 1.0 / (1.0 + math.exp(-scores[0]))
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    return exps[-1] / sum(exps)


@router.post("/v1/rerank", responses=returns(list[SGLangRerankResult]))
async def rerank_sglang(req: RerankRequest, request: Request, state: State) -> Response:
    ranked, outs = await _rerank(state, req, request, "/v1/rerank")
    texts = req.texts()
    return json_response([{"score": score, "index": i, "meta_info": outs[i].meta_info(),
                           **({"document": texts[i]} if req.return_documents else {})}
                          for i, score in ranked])


@router.post("/rerank", responses=returns(RerankResponse))
@router.post("/v2/rerank", responses=returns(RerankResponse))
async def rerank(req: RerankRequest, request: Request, state: State) -> Response:
    ranked, outs = await _rerank(state, req, request, request.url.path)
    texts = req.texts()
    results: list[dict[str, Any]] = [
        {"index": i, "relevance_score": score,
         **({"document": {"text": texts[i]}} if req.return_documents else {})}
        for i, score in ranked]
    used = sum(o.prompt_tokens for o in outs)
    return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": state.openai.model_name,
                          "results": results,
                          "usage": {"prompt_tokens": used, "total_tokens": used}})


@router.post("/v1/score", responses=returns(ScoreResponse))
async def score(req: ScoreRequest, request: Request, state: State) -> Response:
    """Each (item, label) is one prefill-only request of query + item + label whose last prompt
    logprob is the label's: SGLang's scores without a decode step."""
    state.tm.check_kind("generate", "/v1/score")
    state.openai.check_model(req.model)
    tm = state.tm
    items = [req.items] if isinstance(req.items, str) or (req.items and isinstance(req.items[0], int)) else req.items
    if not items:
        raise RequestError("items: give at least one item")
    texts = isinstance(req.query, str)
    if any(isinstance(item, str) != texts for item in items):
        raise RequestError("query and items: all text or all token ids, not both")
    labels = tm.check_ids(req.label_token_ids, "label_token_ids")
    prompts: list[tuple[str | None, list[int] | None]] = []
    for item in items:
        first, second = (item, req.query) if req.item_first else (req.query, item)
        ids = (await tm.tokenize_text(first + second)) if texts else tm.check_ids(first + second, "items")
        if not ids:
            raise RequestError("query and item: together they are no tokens; nothing to score after")
        prompts += [(None, ids + [label]) for label in labels]
    singles = [TokenizedGenerateReq("", ids, SamplingParams(max_new_tokens=0), return_logprob=True,
                                    logprob_start_len=len(ids) - 2, prompt_index=i)
               for i, (_, ids) in enumerate(prompts)]
    if len(singles) > state.args.max_batch_size:
        raise RequestError(f"{len(singles)} (item, label) pairs; this server takes at most "
                           f"{state.args.max_batch_size} per request (--max-batch-size)")
    outs = await run_to_completion(tm, singles, request)
    scores = []
    for i in range(len(items)):
        row = [o.input_token_logprobs[-1].logprob for o in outs[i * len(labels):(i + 1) * len(labels)]]
        if req.apply_softmax:
            top = max(row)
            exps = [math.exp(x - top) for x in row]
            scores.append([e / sum(exps) for e in exps])
        else:
            scores.append([math.exp(x) for x in row])
    used = sum(o.prompt_tokens for o in outs)
    return json_response({"scores": scores, "model": state.openai.model_name, "object": "scoring",
                          "usage": {"prompt_tokens": used, "completion_tokens": 0, "total_tokens": used}})

"""SGLang's native HTTP API: health, model and server info, /generate, tokenization, cache and
abort control, Prometheus metrics. Each route is declared by its path (several paths or methods
on one handler are stacked decorators), so `grep '"/generate"'` finds it; the server's parts come
in as the `State` parameter."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from lockstep import __version__
from lockstep.entrypoints.app_state import State, returns, returns_text
from lockstep.entrypoints.fanout import (
    run_to_completion,
    sglang_chunks,
    sglang_output,
    start_stream,
)
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.entrypoints.metrics import CONTENT_TYPE
from lockstep.entrypoints.middleware import JSONRoute, unavailable_response
from lockstep.entrypoints.openai.protocol import AbortRequestInput
from lockstep.entrypoints.openai.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)
from lockstep.messages import TokenizedGenerateReq
from lockstep.sampling_params import SamplingParams
from lockstep.utils.asgi import SSEResponse
from lockstep.utils.http import SSE_DONE, error_response, json_response, sse

HEALTH_GENERATE_TIMEOUT = 60.0
HEALTHY = {"status": "ok"}  # /health and /health_generate: JSON, as their schema says

router = APIRouter(route_class=JSONRoute)


class GenerateResponse(BaseModel):
    """One /generate output (a batch or n > 1 answers a list of them, each with its index)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None


class Healthy(BaseModel):
    status: Literal["ok"]


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield sse(chunk)
    yield SSE_DONE


@router.get("/health", responses=returns(Healthy))
@router.head("/health", responses=returns(Healthy))
async def health(state: State) -> Response:
    why = state.status.unavailable()
    return json_response(HEALTHY) if why is None else unavailable_response(why)


@router.get("/health_generate", responses=returns(Healthy))
async def health_generate(state: State) -> Response:
    tok = state.tm.tokenizer
    first = tok.bos_token_id if tok.bos_token_id is not None else 0
    single = [TokenizedGenerateReq(f"health-{uuid.uuid4().hex}", [first],
                                   SamplingParams(max_new_tokens=int(state.tm.kind == "generate"),
                                                  temperature=0.0))]
    try:
        await asyncio.wait_for(run_to_completion(state.tm, single, None), HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        return error_response("the scheduler did not answer a 1-token generation in "
                              f"{HEALTH_GENERATE_TIMEOUT:.0f} s", 503)
    return json_response(HEALTHY)


# SGLang 0.5 serves both names of each; its router asks /server_info and /model_info first.
@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(state: State) -> Response:
    info, tm = state.launched.info, state.tm
    return json_response({
        **{k: info[k] for k in ("model_path", "served_model_name", "tokenizer_path", "model_dir",
                                "model_type", "architectures")},
        "is_generation": True, "context_len": tm.context_len, "vocab_size": tm.vocab_size,
        "has_chat_template": state.openai.chat_template is not None,
        "tool_call_parser": state.openai.tool_call_parser,
    })


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(state: State) -> Response:
    return json_response({**state.launched.server_info(), "version": __version__,
                          "uptime_s": round(time.time() - state.started, 3)})


@router.get("/metrics", responses=returns_text(CONTENT_TYPE))
async def get_metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.post("/generate", responses=returns(GenerateResponse | list[GenerateResponse], stream=True))
@router.put("/generate", responses=returns(GenerateResponse | list[GenerateResponse], stream=True))
async def generate(obj: GenerateReqInput, request: Request, state: State) -> Response:
    state.tm.check_kind("generate", "/generate")
    singles = obj.normalize(state.args.max_batch_size)
    many = obj.is_batch or len(singles) > 1
    if obj.stream:
        fan = await start_stream(state.tm, singles, request)
        return SSEResponse(_sse(sglang_chunks(fan, state.args.incremental_streaming_output, many)))
    outs = [sglang_output(item) for item in await run_to_completion(state.tm, singles, request)]
    return json_response(outs if many else outs[0])


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize_route(req: TokenizeRequest, state: State) -> Response:
    return json_response(await tokenize(state.openai, req))


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize_route(req: DetokenizeRequest, state: State) -> Response:
    return json_response(detokenize(state.openai, req))


@router.post("/flush_cache", responses=returns_text("text/plain"))
@router.get("/flush_cache", responses=returns_text("text/plain"))
async def flush_cache(state: State) -> Response:
    out = await state.tm.flush_cache()
    if out.success:
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse(f"Cache not flushed: {out.message}\n", status_code=400)


@router.post("/abort_request")
async def abort_request(body: AbortRequestInput, state: State) -> Response:
    rids = list(state.tm.states) if body.abort_all else [body.rid]
    for r in rids:
        await state.tm.abort(r)
    return json_response({"aborted": rids})

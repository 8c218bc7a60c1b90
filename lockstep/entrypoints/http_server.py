"""The HTTP app: SGLang's native API and OpenAI's, on FastAPI in the front process. Bodies are
pydantic models declared as route parameters, so FastAPI validates them and /openapi.json
describes them; every error is OpenAI's JSON shape (entrypoints/errors.py); /health is 503 while
the server starts, drains, or after a child process died."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from lockstep import __version__
from lockstep.core import SamplingParams
from lockstep.entrypoints import chat_page
from lockstep.entrypoints.engine import Launched
from lockstep.entrypoints.errors import install_error_handlers
from lockstep.entrypoints.fanout import (
    run_to_completion,
    sglang_chunks,
    sglang_output,
    start_stream,
)
from lockstep.entrypoints.generate_request import GenerateReqInput
from lockstep.entrypoints.metrics import CONTENT_TYPE, Metrics
from lockstep.entrypoints.middleware import (
    GuardMiddleware,
    JSONRoute,
    ServerStatus,
    unavailable_response,
)
from lockstep.entrypoints.openai.protocol import (
    AbortRequestInput,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from lockstep.entrypoints.openai.serving import OpenAIServing
from lockstep.entrypoints.openai.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)
from lockstep.messages import TokenizedGenerateReq
from lockstep.utils.asgi import SSEResponse
from lockstep.utils.http import SSE_DONE, ErrorResponse, error_response, json_response, sse

HEALTH_GENERATE_TIMEOUT = 60.0
HEALTHY = {"status": "ok"}  # /health and /health_generate: JSON, as their schema says


class GenerateResponse(BaseModel):
    """One /generate output (a batch or n > 1 answers a list of them, each with its index)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None


class Healthy(BaseModel):
    status: Literal["ok"]


def _returns(model: Any, stream: bool = False) -> dict[Any, Any]:
    """The 200 response of a route in /openapi.json: `model` as JSON, and SSE when it streams."""
    return {200: {"model": model, **({"content": {"text/event-stream": {}}} if stream else {})}}


def _returns_text(media_type: str) -> dict[Any, Any]:
    return {200: {"content": {media_type: {"schema": {"type": "string"}}}}}


def _operation_id(route: APIRoute) -> str:
    path = route.path_format.strip("/").replace("/", "_").replace("{", "").replace("}", "")
    return f"{next(iter(route.methods)).lower()}_{path or 'root'}"


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield sse(chunk)
    yield SSE_DONE


def create_app(launched: Launched, status: ServerStatus | None = None) -> FastAPI:
    args = launched.args
    tm = launched.tokenizer_manager
    assert tm is not None, "the HTTP server runs on node 0 only"
    if status is None:
        status = ServerStatus(launched)
        status.phase = "ready"
    status.launched = launched
    openai = OpenAIServing(tm, args, launched.info)
    metrics = Metrics(tm, openai.model_name)
    started = time.time()

    app = FastAPI(title="lockstep", version=__version__,
                  description="SGLang's native API and OpenAI's, served by lockstep.",
                  openapi_url="/openapi.json", docs_url=None, redoc_url=None,
                  generate_unique_id_function=_operation_id,
                  responses={"4XX": {"model": ErrorResponse, "description": "What is wrong"},
                             "5XX": {"model": ErrorResponse, "description": "Server error"}})
    app.router.route_class = JSONRoute
    app.add_middleware(GuardMiddleware, api_key=args.api_key,
                       max_body=args.max_request_body_bytes, status=status)
    app.include_router(chat_page.router)  # GET /: the chat page
    app.state.launched = launched
    app.state.metrics = metrics
    app.state.status = status
    install_error_handlers(app)

    async def health() -> Response:
        why = status.unavailable()
        return json_response(HEALTHY) if why is None else unavailable_response(why)

    app.get("/health", responses=_returns(Healthy))(health)
    app.head("/health", responses=_returns(Healthy))(health)

    @app.get("/health_generate", responses=_returns(Healthy))
    async def health_generate() -> Response:
        tok = tm.tokenizer
        first = tok.bos_token_id if tok.bos_token_id is not None else 0
        single = [TokenizedGenerateReq(f"health-{uuid.uuid4().hex}", [first],
                                       SamplingParams(max_new_tokens=1, temperature=0.0))]
        try:
            await asyncio.wait_for(run_to_completion(tm, single, None), HEALTH_GENERATE_TIMEOUT)
        except asyncio.TimeoutError:
            return error_response("the scheduler did not answer a 1-token generation in "
                                  f"{HEALTH_GENERATE_TIMEOUT:.0f} s", 503)
        return json_response(HEALTHY)

    # SGLang 0.5 serves both names; its router asks /server_info and /model_info first.
    async def model_info() -> Response:
        return json_response({
            **{k: launched.info[k] for k in (
                "model_path", "served_model_name", "tokenizer_path", "model_dir", "model_type",
                "architectures")},
            "is_generation": True, "context_len": tm.context_len, "vocab_size": tm.vocab_size,
            "has_chat_template": openai.chat_template is not None,
            "tool_call_parser": openai.tool_call_parser,
        })

    async def server_info() -> Response:
        return json_response({**launched.server_info(), "version": __version__,
                              "uptime_s": round(time.time() - started, 3)})

    for path, route in (("/model_info", model_info), ("/get_model_info", model_info),
                        ("/server_info", server_info), ("/get_server_info", server_info)):
        app.get(path)(route)

    @app.get("/v1/models", responses=_returns(ModelList))
    async def list_models() -> Response:
        return json_response(openai.models())

    @app.get("/v1/models/{model:path}", responses=_returns(ModelCard))
    async def get_model(model: str) -> Response:
        openai.check_model(model)
        return json_response(openai.models()["data"][0])

    @app.get("/metrics", responses=_returns_text(CONTENT_TYPE))
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def generate(obj: GenerateReqInput, request: Request) -> Response:
        singles = obj.normalize(args.max_batch_size)
        many = obj.is_batch or len(singles) > 1
        if obj.stream:
            fan = await start_stream(tm, singles, request)
            return SSEResponse(_sse(sglang_chunks(fan, args.incremental_streaming_output, many)))
        outs = [sglang_output(item) for item in await run_to_completion(tm, singles, request)]
        return json_response(outs if many else outs[0])

    for method in (app.post, app.put):
        method("/generate", responses=_returns(GenerateResponse | list[GenerateResponse],
                                               stream=True))(generate)

    @app.post("/v1/completions", responses=_returns(CompletionResponse, stream=True))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await openai.completions(req, request)

    @app.post("/v1/chat/completions", responses=_returns(ChatCompletionResponse, stream=True))
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await openai.chat(req, request)

    async def tokenize_route(req: TokenizeRequest) -> Response:
        return json_response(await tokenize(openai, req))

    async def detokenize_route(req: DetokenizeRequest) -> Response:
        return json_response(detokenize(openai, req))

    for prefix in ("", "/v1"):
        app.post(prefix + "/tokenize")(tokenize_route)
        app.post(prefix + "/detokenize")(detokenize_route)

    async def flush_cache() -> Response:
        out = await tm.flush_cache()
        if out.success:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(f"Cache not flushed: {out.message}\n", status_code=400)

    for method in (app.post, app.get):
        method("/flush_cache", responses=_returns_text("text/plain"))(flush_cache)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequestInput) -> Response:
        rids = list(tm.states) if body.abort_all else [body.rid]
        for r in rids:
            await tm.abort(r)
        return json_response({"aborted": rids})

    return app

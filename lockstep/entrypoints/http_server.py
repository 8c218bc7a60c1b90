"""The HTTP server: SGLang's native API and OpenAI's, on FastAPI + uvicorn in the front process.

`launch_server(args)` listens at once and answers 503 while it starts the scheduler and
detokenizer processes through the shared launch path, then serves `create_app(launched)`.
SIGTERM drains (new requests get 503, running ones finish for up to --graceful-shutdown-timeout
seconds) and then ends every process; SIGINT ends them at once. /health is 200 only while the
server is ready: 503 while starting, draining, or after a child process died.

Every error is a JSON object in OpenAI's shape ({"error": {"message", "type", "param", "code"}})
with a 4xx status for anything the client got wrong; nothing a client sends reaches a process
unvalidated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pydantic
import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response

from lockstep.entrypoints.engine import (
    Launched,
    LaunchError,
    install_signal_handlers,
    launch_subprocesses,
)
from lockstep.entrypoints.openai_api import (
    SSE_DONE,
    ClientGone,
    OpenAIServing,
    SSEResponse,
    check_fanout,
    error_response,
    json_response,
    run_to_completion,
    sse,
    start_stream,
)
from lockstep.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    error_body,
    format_validation_error,
)
from lockstep.managers.tokenizer_manager import RETRY_AFTER_S, RequestError, TokenizerManager
from lockstep.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT = 60.0
_NO_AUTH_PATHS = frozenset({"/health"})
# Routes that start generations: refused with 503 while the server drains or is going down.
_GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions",
                               "/health_generate"})
# After the drain: a moment for the aborts of requests still running to reach their clients.
ABORT_GRACE_S = 2.0


class ServerStatus:
    """The front process's phase: starting -> ready -> draining; `dead` once a child died."""

    def __init__(self, launched: Launched | None = None) -> None:
        self.phase = "starting"
        self.launched = launched

    @property
    def dead(self) -> str | None:
        return self.launched.failed if self.launched is not None else None

    def unavailable(self) -> str | None:
        """Why the server takes no new requests now, or None when it does."""
        if self.dead:
            return f"the server is going down: {self.dead}"
        if self.phase == "starting":
            return "the server is starting; retry shortly"
        if self.phase == "draining":
            return "the server is shutting down; send new requests elsewhere"
        return None


def unavailable_response(message: str) -> Response:
    resp = error_response(message, 503)
    resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp


def version() -> str:
    from lockstep import __version__

    return __version__


# ---------------------------------------------------------------------------------------------
# Request bodies and guards


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, or a RequestError saying why it is not (size, UTF-8, syntax)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body is {declared} bytes; the limit is {limit}", 413)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"request body exceeds the limit of {limit} bytes", 413)
            chunks.append(chunk)
    except ClientDisconnect as e:  # gone before its body arrived: nobody to answer, nothing to log
        raise ClientGone() from e
    body = b"".join(chunks)
    if not body.strip():
        raise RequestError("request body is empty; send a JSON object")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"request body is not valid UTF-8 (bad byte at offset {e.start})") from e
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e


class GuardMiddleware:
    """Pure ASGI (streams and disconnects pass straight through): the API key on every route but
    /health, a declared Content-Length over the limit refused before the body is read, and 503
    (with Retry-After) on the generation routes while the server drains or goes down."""

    def __init__(self, app: Any, api_key: str | None, max_body: int,
                 status: ServerStatus | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body = max_body
        self.status = status

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            path = scope.get("path")
            refusal = None
            if self.expected is not None and path not in _NO_AUTH_PATHS:
                given = headers.get(b"authorization", b"")
                if not secrets.compare_digest(given, self.expected):
                    msg = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                           else "invalid API key")
                    refusal = error_response(msg, 401)
                    refusal.headers["WWW-Authenticate"] = "Bearer"
            length = headers.get(b"content-length", b"")
            if refusal is None and length.isdigit() and int(length) > self.max_body:
                refusal = error_response(
                    f"request body is {int(length)} bytes; the limit is {self.max_body}", 413)
            if refusal is None and self.status is not None and path in _GENERATION_PATHS:
                why = self.status.unavailable()
                if why is not None:
                    refusal = unavailable_response(why)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    """Prometheus metrics fed by the tokenizer manager's observer hook, plus gauges read at
    scrape time. Queued = admitted to the server but no token yet; KV usage counts the prompt and
    output tokens of live requests against the pool (the prefix cache's idle entries excluded)."""

    def __init__(self, tm: TokenizerManager, model_name: str) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            disable_created_metrics,
        )

        disable_created_metrics()  # the *_created series only double the scrape

        self.tm = tm
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]
        self.labels = {"model_name": model_name}
        self.prompt_tokens = Counter("lockstep:prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=reg).labels(**self.labels)
        self.generation_tokens = Counter("lockstep:generation_tokens", "Tokens generated.",
                                         labels, registry=reg).labels(**self.labels)
        self.cached_tokens = Counter("lockstep:cached_tokens",
                                     "Prompt tokens served from the prefix cache.",
                                     labels, registry=reg).labels(**self.labels)
        self.requests = Counter("lockstep:num_requests", "Finished requests by finish reason.",
                                ["model_name", "finish_reason"], registry=reg)
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
        self.ttft = Histogram("lockstep:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=latency, registry=reg).labels(**self.labels)
        self.itl = Histogram("lockstep:inter_token_latency_seconds",
                             "Time between consecutive output tokens.", labels,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                      0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0), registry=reg
                             ).labels(**self.labels)
        self.e2e = Histogram("lockstep:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=latency, registry=reg).labels(**self.labels)
        gauges = {
            "lockstep:num_running_reqs": ("Requests generating tokens.", self._running),
            "lockstep:num_queue_reqs": ("Requests waiting for their first token.", self._queued),
            "lockstep:token_usage": ("Share of the KV pool held by live requests.", self._usage),
            "lockstep:cache_hit_rate": ("Prompt tokens served from the prefix cache / all.",
                                        self._hit_rate),
            "lockstep:max_total_num_tokens": ("KV pool size in tokens.",
                                              lambda: float(tm.max_total_num_tokens)),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, labels, registry=reg).labels(**self.labels).set_function(fn)
        self._prompt_total = 0
        self._cached_total = 0
        tm.observers.append(self.observe)

    def _running(self) -> float:
        return float(sum(1 for s in self.tm.states.values() if s.first_token_time is not None))

    def _queued(self) -> float:
        return float(sum(1 for s in self.tm.states.values() if s.first_token_time is None))

    def _usage(self) -> float:
        used = sum(len(s.prompt_ids) + len(s.output_ids) for s in self.tm.states.values())
        return min(1.0, used / max(1, self.tm.max_total_num_tokens))

    def _hit_rate(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def observe(self, state: Any, out: Any) -> None:
        now = time.perf_counter()
        if not getattr(state, "_metrics_seen", False):
            state._metrics_seen = True
            self.prompt_tokens.inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self._prompt_total += out.prompt_tokens
            self._cached_total += out.cached_tokens
        n = len(out.new_token_ids)
        if n:
            self.generation_tokens.inc(n)
            last = getattr(state, "_metrics_last_token", None)
            if last is None:
                self.ttft.observe(now - state.created)
            else:
                for _ in range(n):
                    self.itl.observe((now - last) / n)
            state._metrics_last_token = now
        if out.finish_reason is not None:
            self.e2e.observe(now - state.created)
            kind = str(out.finish_reason.get("type", "unknown"))
            self.requests.labels(finish_reason=kind, **self.labels).inc()

    def render(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------------------------------
# The native /generate API


class NativeServing:
    def __init__(self, tm: TokenizerManager, args: ServerArgs) -> None:
        self.tm = tm
        self.incremental = args.incremental_streaming_output
        self.max_batch_size = args.max_batch_size

    async def generate(self, body: Any, request: Request | None) -> Response:
        obj = GenerateReqInput.model_validate(body)
        check_fanout(obj, self.max_batch_size)
        try:
            singles = obj.normalize()
        except ValueError as e:
            raise RequestError(str(e)) from e
        many = obj.is_batch or len(singles) > 1
        if obj.stream:
            fan = await start_stream(self.tm, singles, request)
            return SSEResponse(self._stream(fan, len(singles), many))
        finals = await run_to_completion(self.tm, singles, request)
        outs = [self._shape(item) for item in finals]
        return json_response(outs if many else outs[0])

    @staticmethod
    def _shape(item: dict[str, Any]) -> dict[str, Any]:
        return {"text": item["text"], "output_ids": item["output_ids"],
                "meta_info": item["meta_info"]}

    async def _stream(self, fan: Any, count: int, many: bool) -> AsyncIterator[bytes]:
        sent = [dict(out=0, out_top=0, prompt=False) for _ in range(count)]
        try:
            async for index, item in fan.items():
                if self.incremental:
                    out = {"text": item["text_delta"], "output_ids": item["new_token_ids"],
                           "meta_info": _meta_delta(item["meta_info"], sent[index])}
                else:
                    out = self._shape(item)
                if many:
                    out["index"] = index
                yield sse(out)
            yield SSE_DONE
        finally:
            fan.close()


def _meta_delta(meta: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any]:
    """Incremental streaming: logprobs only for what is new since the last event."""
    if "output_token_logprobs" not in meta:
        return meta
    meta = dict(meta)
    outs = meta["output_token_logprobs"]
    meta["output_token_logprobs"] = outs[sent["out"]:]
    sent["out"] = len(outs)
    if "output_top_logprobs" in meta:
        tops = meta["output_top_logprobs"]
        meta["output_top_logprobs"] = tops[sent["out_top"]:]
        sent["out_top"] = len(tops)
    if sent["prompt"]:
        meta["input_token_logprobs"] = []
        if "input_top_logprobs" in meta:
            meta["input_top_logprobs"] = []
    sent["prompt"] = True
    return meta


# ---------------------------------------------------------------------------------------------
# The app


def create_app(launched: Launched, status: ServerStatus | None = None) -> FastAPI:
    args = launched.args
    tm = launched.tokenizer_manager
    assert tm is not None, "the HTTP server runs on node 0 only"
    if status is None:
        status = ServerStatus(launched)
        status.phase = "ready"
    status.launched = launched
    max_body = args.max_request_body_bytes
    native = NativeServing(tm, args)
    openai = OpenAIServing(tm, args, launched.info)
    metrics = Metrics(tm, openai.model_name)
    started = time.time()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        tm.start()
        yield

    app = FastAPI(title="lockstep", version=version(), lifespan=lifespan,
                  openapi_url="/openapi.json", docs_url=None, redoc_url=None)
    app.add_middleware(GuardMiddleware, api_key=args.api_key, max_body=max_body, status=status)
    app.state.launched = launched
    app.state.metrics = metrics
    app.state.status = status

    @app.exception_handler(RequestError)
    async def _request_error(_req: Request, exc: RequestError) -> Response:
        resp = error_response(str(exc), exc.status)
        resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(pydantic.ValidationError)
    async def _validation_error(_req: Request, exc: pydantic.ValidationError) -> Response:
        return error_response(format_validation_error(exc), 400)

    @app.exception_handler(ClientGone)
    async def _client_gone(_req: Request, _exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> Response:
        message = {404: f"no route {req.url.path}",
                   405: f"method {req.method} is not allowed on {req.url.path}"}
        resp = error_response(message.get(exc.status_code, str(exc.detail)), exc.status_code)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(Exception)
    async def _internal_error(req: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s %s", req.method, req.url.path)
        return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500)

    # ---- health and info ---------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        why = status.unavailable()
        return Response(status_code=200) if why is None else unavailable_response(why)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        tok = tm.tokenizer
        first = tok.bos_token_id if tok.bos_token_id is not None else 0
        single = GenerateReqInput(
            input_ids=[first], rid=f"health-{uuid.uuid4().hex}",
            sampling_params={"max_new_tokens": 1, "temperature": 0.0}).normalize()
        try:
            await asyncio.wait_for(run_to_completion(tm, single, None), HEALTH_GENERATE_TIMEOUT)
        except asyncio.TimeoutError:
            return error_response("the scheduler did not answer a 1-token generation in "
                                  f"{HEALTH_GENERATE_TIMEOUT:.0f} s", 503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return json_response({
            # SGLang's frontend picks a chat template by this name, so never send null.
            "model_path": args.model_path or openai.model_name,
            "served_model_name": openai.model_name,
            "tokenizer_path": args.tokenizer_path or launched.info.get("model_dir"),
            "model_dir": launched.info.get("model_dir"), "is_generation": True,
            "context_len": tm.context_len, "vocab_size": tm.vocab_size,
            "has_chat_template": openai.chat_template is not None,
        })

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        info = dataclasses.asdict(args)
        if info.get("api_key"):
            info["api_key"] = "<redacted>"
        info.update(
            version=version(), max_total_num_tokens=tm.max_total_num_tokens,
            context_len=tm.context_len, vocab_size=tm.vocab_size,
            num_running_requests=tm.num_running, uptime_s=round(time.time() - started, 3),
        )
        return json_response(info)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(openai.models())

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        openai.check_model(model)
        return json_response(openai.models()["data"][0])

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return metrics.render()

    # ---- generation ----------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        return await native.generate(await read_json(request, max_body), request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai.completions(await read_json(request, max_body), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai.chat(await read_json(request, max_body), request)

    # ---- control -------------------------------------------------------------------------
    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache() -> Response:
        out = await tm.flush_cache()
        if out.success:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(f"Cache not flushed: {out.message}\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request, max_body)
        if not isinstance(body, dict) or set(body) - {"rid", "abort_all"}:
            raise RequestError('send {"rid": "<request id>"} or {"abort_all": true}')
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if abort_all is True:
            rids = list(tm.states)
        elif isinstance(rid, str) and rid:
            rids = [rid]
        else:
            raise RequestError('rid: must be a non-empty string (or send {"abort_all": true})')
        for r in rids:
            await tm.abort(r)
        return json_response({"aborted": rids})

    app.openapi = lambda: openapi_schema(  # type: ignore[method-assign]
        app, tm.vocab_size, tm.context_len)
    return app


# Request bodies of the routes that read raw JSON (they validate it themselves, for one readable
# error message): declared here so /openapi.json describes every route, and fuzzers can use it.
_ABORT_BODY = {"type": "object", "additionalProperties": False,
               "properties": {"rid": {"type": "string", "minLength": 1},
                              "abort_all": {"type": "boolean"}}}
_REQUEST_BODIES: dict[tuple[str, str], Any] = {
    ("/generate", "post"): GenerateReqInput, ("/generate", "put"): GenerateReqInput,
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/abort_request", "post"): _ABORT_BODY,
}


_NULL = {"type": "null"}
_TEXT_PART = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_EMPTY_OBJECT = {"anyOf": [{"type": "object", "maxProperties": 0}, _NULL]}
# What the models' own validators enforce beyond their field types, stated in the schema so that
# a schema-driven client (or fuzzer) can build requests the server accepts: {model: {property:
# schema}}, with "" for the model itself.
_SCHEMA_REFINEMENTS: dict[str, dict[str, Any]] = {
    "GenerateReqInput": {"": {"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}},
    "ChatMessage": {"content": {"anyOf": [{"type": "string"},
                                          {"type": "array", "items": _TEXT_PART}, _NULL]}},
    "ChatCompletionRequest": {
        "tools": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]},
        "tool_choice": {"enum": ["none", "auto", None]},
        "response_format": {"anyOf": [{"type": "object", "additionalProperties": False,
                                       "required": ["type"],
                                       "properties": {"type": {"const": "text"}}}, _NULL]},
        "logit_bias": _EMPTY_OBJECT,
    },
    "CompletionRequest": {"logit_bias": _EMPTY_OBJECT,
                          "suffix": {"anyOf": [{"type": "string", "maxLength": 0}, _NULL]}},
}


_TOKEN_ID_FIELDS = frozenset({"input_ids", "prompt", "stop_token_ids"})
_LENGTH_FIELDS = frozenset({"max_new_tokens", "min_new_tokens", "max_tokens", "min_tokens",
                            "max_completion_tokens"})


def _cap(node: Any, maximum: int) -> None:
    """Lower every integer "maximum" under `node` to `maximum`."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("maximum", maximum) > maximum:
            node["maximum"] = maximum
        for value in node.values():
            _cap(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _cap(value, maximum)


def _refine(components: dict[str, Any], vocab_size: int, context_len: int) -> None:
    for model in components.values():
        for prop, schema in model.get("properties", {}).items():
            if prop in _TOKEN_ID_FIELDS:
                _cap(schema, vocab_size - 1)
            elif prop in _LENGTH_FIELDS:
                _cap(schema, context_len - 1)
    for name, changes in _SCHEMA_REFINEMENTS.items():
        model = components.get(name)
        if model is None:
            continue
        for prop, schema in changes.items():
            if prop == "":
                model.update(schema)
            elif prop in model.get("properties", {}):
                old = model["properties"][prop]
                model["properties"][prop] = {
                    **{k: old[k] for k in ("title", "default") if k in old}, **schema}


def openapi_schema(app: FastAPI, vocab_size: int, context_len: int) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    with warnings.catch_warnings():  # routes with several methods: ids made unique below
        warnings.filterwarnings("ignore", message="Duplicate Operation ID")
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="SGLang's native API and OpenAI's, served by lockstep.")
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            op["operationId"] = f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '') or 'root'}"
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for (path, method), model in _REQUEST_BODIES.items():
        op = schema.get("paths", {}).get(path, {}).get(method)
        if op is None:
            continue
        if isinstance(model, dict):
            body = model
        else:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
            body = {"$ref": f"#/components/schemas/{model.__name__}"}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    _refine(components, vocab_size, context_len)
    app.openapi_schema = schema
    return schema


# ---------------------------------------------------------------------------------------------
# Launch


def _bind(host: str, port: int) -> socket.socket:
    """Bind before the (slow) model load so a taken port fails at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise LaunchError(f"cannot bind {host}:{port}: {e.strerror or e}") from e
    return sock


def _url(args: ServerArgs) -> str:
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


class StartupResponder:
    """While the processes start: every request on the (already listening) socket gets a 503
    with Retry-After, so that load balancers and clients see "starting" rather than a refused
    connection. A plain thread, so the launch (whose children must be spawned by the main thread:
    PR_SET_PDEATHSIG follows the spawning thread) goes on undisturbed; `stop()` leaves the
    socket open for uvicorn."""

    MAX_DRAIN_BYTES = 1 << 20

    def __init__(self, sock: socket.socket) -> None:
        body = orjson.dumps(error_body("the server is starting; retry shortly", 503))
        drain_limit = self.MAX_DRAIN_BYTES

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def refuse(self) -> None:
                with contextlib.suppress(ValueError, OSError):
                    length = int(self.headers.get("Content-Length") or 0)
                    if 0 < length <= drain_limit:
                        self.rfile.read(length)
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Retry-After", str(RETRY_AFTER_S))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                self.close_connection = True

            do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = refuse

            def log_message(self, *_args: Any) -> None:
                pass

        server = ThreadingHTTPServer(sock.getsockname()[:2], Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.daemon_threads = True
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True,
                                       name="lockstep-startup-503")

    def start(self) -> StartupResponder:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()  # stops accepting; the socket stays open


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, except that SIGTERM drains first: the status turns "draining" (new
    generations and /health get 503), running requests get up to --graceful-shutdown-timeout
    seconds to finish, what is left is aborted, and then uvicorn shuts down as usual. A second
    SIGTERM, or SIGINT, stops at once."""

    def __init__(self, config: uvicorn.Config, status: ServerStatus, launched: Launched) -> None:
        super().__init__(config)
        self.status = status
        self.launched = launched
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if (sig == signal.SIGTERM and self.status.phase == "ready" and self.loop is not None
                and not self.should_exit):
            self.status.phase = "draining"
            self.loop.call_soon_threadsafe(self._begin_drain)
            return
        super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        self.drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        tm = self.launched.tokenizer_manager
        assert tm is not None
        grace = self.launched.args.graceful_shutdown_timeout
        loop = asyncio.get_running_loop()
        logger.info("SIGTERM: refusing new requests; %d running request(s) get up to %g s to "
                    "finish", len(tm.states), grace)
        deadline = loop.time() + grace
        while tm.states and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if tm.states:
            rids = list(tm.states)
            logger.warning("graceful shutdown: %d request(s) still running after %g s; aborting "
                           "them", len(rids), grace)
            reason = {"type": "abort", "message": "the server is shutting down", "status_code": 503}
            for rid in rids:
                await tm.abort(rid, reason)
            end = loop.time() + ABORT_GRACE_S
            while tm.states and loop.time() < end:
                await asyncio.sleep(0.05)
        else:
            logger.info("graceful shutdown: every request finished")
        super().handle_exit(signal.SIGTERM, None)


def launch_server(args: ServerArgs) -> None:
    """Start every process, serve until SIGINT/SIGTERM, then end them all."""
    from lockstep.utils.process import configure_logging

    configure_logging(args.log_level, "server")
    if args.chat_template:
        from lockstep.entrypoints.chat_templates import ChatTemplateError, resolve_chat_template

        try:
            resolve_chat_template(args.chat_template, None, "", [])
        except ChatTemplateError as e:
            logger.error("%s", e)
            sys.exit(2)
    responder: StartupResponder | None = None
    try:
        sock = _bind(args.host, args.port)
        if args.node_rank == 0:  # answer 503 while the model loads
            sock.listen(2048)
            responder = StartupResponder(sock).start()
        launched = launch_subprocesses(args)
    except LaunchError as e:
        logger.error("%s", e)
        sys.exit(1)
    except Exception as e:  # ModelLoadError and friends: one line, not a traceback
        logger.error("startup failed: %s: %s", type(e).__name__, e)
        sys.exit(1)
    install_signal_handlers(launched)
    if launched.tokenizer_manager is None:
        # Nodes other than 0 run only their scheduler ranks; node 0 serves. The watchdog ends
        # this process when a rank exits (for example when node 0 goes away).
        logger.info("node %d: %d scheduler rank(s) running; node 0 serves requests",
                    args.node_rank, len(launched.children))
        for p in launched.children:
            p.join()
        return
    try:
        status = ServerStatus(launched)
        app = create_app(launched, status)
        config = uvicorn.Config(
            app, log_config=None, log_level=args.log_level, access_log=args.log_level == "debug",
            timeout_graceful_shutdown=5, timeout_keep_alive=30, lifespan="on",
            loop="none",
        )
        server = DrainingServer(config, status, launched)

        async def main() -> None:
            server.loop = asyncio.get_running_loop()

            async def announce() -> None:
                while not server.started:
                    await asyncio.sleep(0.05)
                status.phase = "ready"
                info = launched.info
                logger.info("model %s: context %s tokens, KV pool %s tokens",
                            args.model_path or "(default) Gemma 3 270M", info.get("context_len"),
                            info.get("max_total_num_tokens"))
                logger.info("serving on %s", _url(args))

            task = asyncio.get_running_loop().create_task(announce())
            try:
                if responder is not None:
                    responder.stop()  # uvicorn takes over the listening socket
                await server.serve(sockets=[sock])
            finally:
                task.cancel()

        _run(main())
    finally:
        launched.shutdown()


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)

"""The router's HTTP app and command line (`lockstep router`); routing itself is in router.py."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response

from lockstep.router.metrics import render as render_metrics
from lockstep.router.policies import routing_text
from lockstep.router.router import Router, RouterConfig
from lockstep.utils.asgi import BodyLimit, unless_disconnected
from lockstep.utils.flags import add_flags, from_flags
from lockstep.utils.http import error_response, json_response

logger = logging.getLogger("lockstep.router")

MAX_BODY_BYTES = 32 * 1024 * 1024
# Request headers worth passing on; hop-by-hop ones and Host/Content-Length are aiohttp's job.
_FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "user-agent")


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_REQUEST_HEADERS}


def _the_router(request: Request) -> Router:
    return request.app.state.router


# A route's parameter `router: Routing` receives the app's Router (a FastAPI dependency).
Routing = Annotated[Router, Depends(_the_router)]

# The router's HTTP API, each route declared by its path. Several paths on one handler are
# stacked decorators; a handler that forwards reads its own path from the request, which for
# these fixed paths is the route's, never something the client chose.
routes = APIRouter()


def create_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        logger.info("routing to %d worker(s) (%d healthy) with policy %s",
                    len(router.workers), len(router.healthy()), router.policy.name)
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="lockstep router", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.state.router = router
    app.add_middleware(BodyLimit, max_body=MAX_BODY_BYTES)
    app.include_router(routes)
    return app


async def _from_one(router: Router, request: Request, path: str) -> Response:
    """Forwarded to the least-loaded healthy worker."""
    body = await request.body() if request.method == "POST" else None
    return await router.dispatch(request.method, path, body, _forward_headers(request),
                                 lambda candidates: min(candidates, key=lambda w: w.load))


@routes.post("/generate")
@routes.put("/generate")
@routes.post("/v1/completions")
@routes.post("/v1/chat/completions")
async def generation(request: Request, router: Routing) -> Response:
    """Forwarded to the worker the policy picks for the prompt (prefix affinity, load)."""
    path = request.url.path
    body = await request.body()
    try:
        parsed = orjson.loads(body) if body.strip() else None
    except orjson.JSONDecodeError:
        parsed = None  # the worker says what is wrong with it
    text = routing_text(path, parsed)
    router.requests += 1
    work = router.dispatch(request.method, path, body, _forward_headers(request),
                           lambda candidates: router.policy.select(candidates, text))
    try:  # cancelled if the client leaves: the worker's request closes, so it aborts
        return await unless_disconnected(request.receive, work)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is listening any more


@routes.get("/v1/models")
@routes.get("/model_info")
@routes.get("/get_model_info")
@routes.get("/health_generate")
@routes.post("/tokenize")
@routes.post("/detokenize")
@routes.post("/v1/tokenize")
@routes.post("/v1/detokenize")
async def from_one(request: Request, router: Routing) -> Response:
    return await _from_one(router, request, request.url.path)


@routes.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str, router: Routing) -> Response:
    return await _from_one(router, request, f"/v1/models/{model}")


@routes.get("/server_info")
@routes.get("/get_server_info")
async def server_info(request: Request, router: Routing) -> Response:
    resp = await _from_one(router, request, request.url.path)
    if resp.status_code == 200:
        with contextlib.suppress(orjson.JSONDecodeError, TypeError):
            info = orjson.loads(resp.body)
            if isinstance(info, dict):
                info["router"] = router.info()
                return json_response(info)
    return resp


@routes.post("/flush_cache")
@routes.get("/flush_cache")
async def flush_cache(request: Request, router: Routing) -> Response:
    results = await router.broadcast(request.method, "/flush_cache", None,
                                     _forward_headers(request))
    router.policy.clear()
    failed = [f"{w.url}: {status or ''} {data.decode(errors='replace').strip()}"
              for w, status, data in results if status != 200]
    if not results:
        return PlainTextResponse("Cache not flushed: no healthy worker.\n", status_code=503)
    if failed:
        return PlainTextResponse("Cache not flushed on every worker:\n" + "\n".join(failed)
                                 + "\n", status_code=400)
    return PlainTextResponse(f"Cache flushed on {len(results)} worker(s).\n")


@routes.post("/abort_request")
async def abort_request(request: Request, router: Routing) -> Response:
    results = await router.broadcast("POST", "/abort_request", await request.body(),
                                     _forward_headers(request))
    aborted: list[str] = []
    for _w, status, data in results:
        if 400 <= status < 500:  # the request itself is wrong: every worker says the same
            return Response(data, status, media_type="application/json")
        if status == 200:
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                aborted += [r for r in orjson.loads(data).get("aborted", [])
                            if r not in aborted]
    if not results:
        return error_response("no healthy worker", 503)
    return json_response({"aborted": aborted})


@routes.get("/health")
@routes.head("/health")
async def health(router: Routing) -> Response:
    if router.healthy():
        return Response(status_code=200)
    return error_response("no healthy worker", 503)


@routes.get("/get_router_info")
async def get_router_info(router: Routing) -> Response:
    return json_response(router.info())


@routes.get("/list_workers")
async def list_workers(router: Routing) -> Response:
    return json_response({"urls": list(router.workers),
                          "workers": [w.info() for w in router.workers.values()]})


@routes.post("/add_worker")
@routes.post("/remove_worker")
async def add_or_remove_worker(request: Request, router: Routing, url: str = "") -> Response:
    route = request.url.path
    adding = route == "/add_worker"
    if not url:
        return error_response(f"pass the worker as a query parameter: {route}?url=URL", 400)
    try:
        worker = await router.add_worker(url) if adding else router.remove_worker(url)
    except ValueError as e:
        return error_response(str(e), 400)
    except KeyError:
        if adding:
            return error_response(f"worker {url} is already in the router", 400)
        return error_response(f"worker {url} is not in the router", 404)
    message = f"Successfully {'added' if adding else 'removed'} worker: {worker.url}"
    return json_response({"success": True, "message": message, "worker": worker.info()})


@routes.get("/metrics")
async def metrics(router: Routing) -> Response:
    return Response(render_metrics(router.workers.values(), router.retries),
                    media_type=CONTENT_TYPE_LATEST)


def build_parser(prog: str = "lockstep router") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Route requests across lockstep servers (the same HTTP API), "
        "by prefix affinity and load.",
        epilog="example:\n  lockstep router --worker-urls http://127.0.0.1:30001 "
        "http://127.0.0.1:30002 --port 30000",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, RouterConfig)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "lockstep router") -> int:
    import uvicorn

    from lockstep.utils.process import configure_logging

    parser = build_parser(prog)
    config = from_flags(parser, RouterConfig, parser.parse_args(
        list(sys.argv[1:] if argv is None else argv)))
    configure_logging(config.log_level, "router")
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_config=None,
                log_level=config.log_level, access_log=config.log_level == "debug",
                timeout_keep_alive=30, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())

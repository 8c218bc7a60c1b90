"""The router: one process in front of several lockstep (or SGLang) servers, speaking their API.

    lockstep router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 \\
        --policy cache_aware --port 30000

- Generation routes (/generate, /v1/completions, /v1/chat/completions) go to the worker the
  policy picks (see policies.py); streams are relayed chunk by chunk as they arrive.
- A request whose attempt fails before anything reached the client — connection refused or
  reset, the worker gone before its first byte, or a 5xx — is retried on another worker, each
  worker at most once. Once a byte has gone to the client a request is never retried, so no
  request is answered twice; a stream cut mid-way ends with an SSE error event and no [DONE].
- Health: every `--health-check-interval` seconds GET /health on each worker; a worker that fails
  it (or refuses a connection) is taken out of rotation until it passes again.
- /health is 200 while at least one worker is healthy; /v1/models, /get_model_info,
  /get_server_info and /health_generate come from one worker; /flush_cache and /abort_request go
  to all of them.
- Admin (SGLang router's names): POST /add_worker?url=URL, POST /remove_worker?url=URL,
  GET /list_workers; GET /get_router_info has per-worker counters and the policy's state.

Client credentials (the Authorization header) are passed through to the workers unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from lockstep.router.metrics import render as render_metrics
from lockstep.router.policies import POLICIES, Policy, make_policy, routing_text
from lockstep.utils.asgi import SSE_HEADERS, DisconnectAwareStreamingResponse, wait_disconnect
from lockstep.utils.http import error_body, error_response, json_response

logger = logging.getLogger("lockstep.router")

MAX_BODY_BYTES = 32 * 1024 * 1024
# Request headers worth passing on; hop-by-hop ones and Host/Content-Length are aiohttp's job.
_FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "user-agent")
_FORWARD_RESPONSE_HEADERS = ("content-type", "www-authenticate", "retry-after")
_RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def normalize_url(url: str) -> str:
    """`http://host:port` with no trailing slash, or ValueError saying what is wrong."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"worker URL {url!r} must look like http://HOST:PORT")
    return url


# ---------------------------------------------------------------------------------------------
# Workers


@dataclass
class Worker:
    url: str
    healthy: bool = False
    load: int = 0  # requests this router has in flight there
    requests: int = 0  # attempts sent there
    completed: int = 0  # answered to the client from there (any status below 500)
    failed: int = 0  # attempts that failed (connection, 5xx, cut stream)
    last_error: str | None = None
    checked_at: float | None = None

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "load": self.load,
                "requests": self.requests, "completed": self.completed, "failed": self.failed,
                "last_error": self.last_error}


@dataclass
class _Failure:
    """An attempt that failed before anything reached the client: retry elsewhere."""

    message: str
    response: Response | None = None  # the worker's own 5xx answer, if it gave one


@dataclass
class RouterConfig:
    worker_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 30000
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 2 ** 24
    health_check_interval: float = 5.0
    health_check_timeout: float = 5.0
    request_timeout: float | None = None
    random_seed: int | None = 0
    log_level: str = "info"


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy: Policy = make_policy(
            config.policy, cache_threshold=config.cache_threshold,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
            max_tree_size=config.max_tree_size, seed=config.random_seed)
        self.workers: dict[str, Worker] = {}
        for url in config.worker_urls:
            url = normalize_url(url)
            self.workers.setdefault(url, Worker(url))
        self.session: aiohttp.ClientSession | None = None
        self.retries = 0
        self.requests = 0
        self._health_task: asyncio.Task[None] | None = None
        self._checks: dict[str, asyncio.Task[bool]] = {}

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=10)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout, sock_connect=10)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        await self.check_all()
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._health_task, *self._checks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # ---- health --------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                logger.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    def check(self, worker: Worker) -> Awaitable[bool]:
        """One GET /health of `worker` (shared by concurrent callers); updates `healthy`."""
        task = self._checks.get(worker.url)
        if task is None or task.done():
            task = self._checks[worker.url] = asyncio.ensure_future(self._check(worker))
        return asyncio.shield(task)

    async def _check(self, worker: Worker) -> bool:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout)
        error = None
        try:
            async with self.session.get(worker.url + "/health", timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    error = f"/health answered {resp.status}"
        except _RETRYABLE as e:
            error = f"/health failed: {type(e).__name__}: {e}"
        first = worker.checked_at is None
        worker.checked_at = time.time()
        if error is None:
            if not worker.healthy and worker.url in self.workers:
                logger.info("worker %s is healthy", worker.url)
            worker.healthy = True
            return True
        if first:
            logger.warning("worker %s is not healthy yet: %s", worker.url, error)
        self.mark_unhealthy(worker, error)
        return False

    def mark_unhealthy(self, worker: Worker, why: str) -> None:
        worker.last_error = why
        if worker.healthy:
            logger.warning("worker %s taken out of rotation: %s", worker.url, why)
        worker.healthy = False

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    # ---- admin ---------------------------------------------------------------------------
    async def add_worker(self, url: str) -> Worker:
        url = normalize_url(url)
        if url in self.workers:
            raise KeyError(url)
        worker = self.workers[url] = Worker(url)
        await self.check(worker)
        logger.info("added worker %s (%s)", url, "healthy" if worker.healthy else "not healthy yet")
        return worker

    def remove_worker(self, url: str) -> Worker:
        worker = self.workers.pop(normalize_url(url))  # KeyError when unknown
        self.policy.remove_worker(worker.url)
        self._checks.pop(worker.url, None)
        logger.info("removed worker %s", worker.url)
        return worker

    def info(self) -> dict[str, Any]:
        return {"policy": self.policy.info(), "requests": self.requests, "retries": self.retries,
                "workers": [w.info() for w in self.workers.values()],
                "health_check_interval": self.config.health_check_interval}

    # ---- dispatch ------------------------------------------------------------------------
    async def dispatch(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                       pick: Callable[[list[Worker]], Worker]) -> Response:
        """Send the request to the worker `pick` chooses among the healthy ones, retrying on
        another while an attempt fails before anything reached the client."""
        tried: set[str] = set()
        last: _Failure | None = None
        while True:
            candidates = [w for w in self.healthy() if w.url not in tried]
            if not candidates:
                break
            worker = pick(candidates)
            tried.add(worker.url)
            if last is not None:
                self.retries += 1
                logger.info("retrying %s %s on %s after: %s", method, path, worker.url,
                            last.message)
            outcome = await self._attempt(worker, method, path, body, headers)
            if not isinstance(outcome, _Failure):
                return outcome
            last = outcome
        if last is None:
            return error_response("no healthy worker to serve the request", 503)
        if last.response is not None:
            return last.response
        return error_response(f"every worker failed; last: {last.message}", 502)

    async def _attempt(self, worker: Worker, method: str, path: str, body: bytes | None,
                       headers: dict[str, str]) -> Response | _Failure:
        assert self.session is not None
        worker.load += 1
        worker.requests += 1
        resp: aiohttp.ClientResponse | None = None
        handed_off = False
        try:
            resp = await self.session.request(method, worker.url + path, data=body,
                                              headers=headers)
            out_headers = {k: v for k, v in resp.headers.items()
                           if k.lower() in _FORWARD_RESPONSE_HEADERS}
            if resp.status >= 500:
                with contextlib.suppress(*_RETRYABLE):
                    data = await resp.read()
                    worker.failed += 1
                    worker.last_error = f"{path} answered {resp.status}"
                    return _Failure(f"{worker.url} answered {resp.status}",
                                    Response(data, resp.status, headers=out_headers))
                worker.failed += 1
                return _Failure(f"{worker.url} answered {resp.status}")
            if resp.content_type == "text/event-stream":
                first = await resp.content.readany()
                if not first:
                    worker.failed += 1
                    return _Failure(f"{worker.url} ended the stream before any event")
                relay = _Relay(self, worker, resp, first)
                handed_off = True
                return RelayResponse(relay, resp.status, {**out_headers, **SSE_HEADERS})
            data = await resp.read()
            worker.completed += 1
            return Response(data, resp.status, headers=out_headers)
        except aiohttp.ClientConnectorError as e:
            worker.failed += 1
            self.mark_unhealthy(worker, f"cannot connect: {e}")
            return _Failure(f"cannot connect to {worker.url}: {e}")
        except _RETRYABLE as e:
            worker.failed += 1
            worker.last_error = f"{type(e).__name__}: {e}"
            self.check(worker)  # a worker that went away is taken out at once
            return _Failure(f"{worker.url} failed: {type(e).__name__}: {e}")
        finally:
            if not handed_off:
                worker.load -= 1
                if resp is not None:
                    resp.close()

    async def broadcast(self, method: str, path: str, body: bytes | None,
                        headers: dict[str, str]) -> list[tuple[Worker, int, bytes]]:
        """The same request to every healthy worker: (worker, status, body); status 0 = failed."""
        assert self.session is not None

        async def one(w: Worker) -> tuple[Worker, int, bytes]:
            try:
                async with self.session.request(method, w.url + path, data=body,
                                                headers=headers) as resp:
                    return w, resp.status, await resp.read()
            except _RETRYABLE as e:
                return w, 0, f"{type(e).__name__}: {e}".encode()

        return list(await asyncio.gather(*(one(w) for w in self.healthy())))


class _Relay:
    """A worker's stream passed on chunk by chunk. `close()` (idempotent) ends the attempt:
    load released, upstream closed — which aborts the request there if it was cut short."""

    def __init__(self, router: Router, worker: Worker, resp: aiohttp.ClientResponse,
                 first: bytes) -> None:
        self.router, self.worker, self.resp, self.first = router, worker, resp, first
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        tail = self.first
        try:
            yield self.first
            async for chunk in self.resp.content.iter_any():
                tail = chunk
                yield chunk
            self.worker.completed += 1
        except _RETRYABLE as e:
            self.worker.failed += 1
            self.worker.last_error = f"stream cut: {type(e).__name__}: {e}"
            self.router.check(self.worker)
            logger.warning("stream from %s cut after the first bytes (not retried): %s",
                           self.worker.url, e)
            sep = b"" if tail.endswith(b"\n\n") else b"\n\n"
            message = f"the worker {self.worker.url} failed mid-stream: {type(e).__name__}"
            yield sep + b"data: " + orjson.dumps(error_body(message, 502)) + b"\n\n"
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.worker.load -= 1
            self.resp.close()


class RelayResponse(DisconnectAwareStreamingResponse):
    """Relays a stream; when it ends or the client leaves, the upstream is closed so the worker
    aborts the request."""

    def __init__(self, relay: _Relay, status_code: int, headers: dict[str, str]) -> None:
        self.relay = relay
        super().__init__(relay.chunks(), status_code, headers=headers)

    def on_close(self) -> None:
        self.relay.close()


async def _unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    """`work`, cancelled (the worker's request closed, so it aborts) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once it is done
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


# ---------------------------------------------------------------------------------------------
# The app


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_REQUEST_HEADERS}


async def _read_body(request: Request) -> bytes | Response:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return error_response(f"request body is {declared} bytes; the limit is {MAX_BODY_BYTES}",
                              413)
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        return error_response(f"request body exceeds the limit of {MAX_BODY_BYTES} bytes", 413)
    return body


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

    def least_loaded(candidates: list[Worker]) -> Worker:
        return min(candidates, key=lambda w: w.load)

    async def generation(request: Request, path: str) -> Response:
        body = await _read_body(request)
        if isinstance(body, Response):
            return body
        try:
            parsed = orjson.loads(body) if body.strip() else None
        except orjson.JSONDecodeError:
            parsed = None  # the worker says what is wrong with it
        text = routing_text(path, parsed)
        router.requests += 1

        def pick(candidates: list[Worker]) -> Worker:
            return router.policy.select(candidates, text)  # type: ignore[return-value]

        work = router.dispatch(request.method, path, body, _forward_headers(request), pick)
        return await _unless_client_leaves(request, work)

    async def from_one(request: Request, path: str) -> Response:
        return await router.dispatch(request.method, path, None, _forward_headers(request),
                                     least_loaded)

    # ---- generation ----------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        return await generation(request, "/generate")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, "/v1/chat/completions")

    # ---- from one worker -----------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return await from_one(request, "/v1/models")

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str) -> Response:
        return await from_one(request, f"/v1/models/{model}")

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> Response:
        return await from_one(request, "/get_model_info")

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        resp = await from_one(request, "/get_server_info")
        if resp.status_code == 200:
            with contextlib.suppress(orjson.JSONDecodeError, TypeError):
                info = orjson.loads(resp.body)
                if isinstance(info, dict):
                    info["router"] = router.info()
                    return json_response(info)
        return resp

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        return await from_one(request, "/health_generate")

    # ---- to every worker -----------------------------------------------------------------
    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache(request: Request) -> Response:
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

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _read_body(request)
        if isinstance(body, Response):
            return body
        results = await router.broadcast("POST", "/abort_request", body,
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

    # ---- the router's own ----------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if router.healthy():
            return Response(status_code=200)
        return error_response("no healthy worker", 503)

    @app.get("/get_router_info")
    async def get_router_info() -> Response:
        return json_response(router.info())

    @app.get("/list_workers")
    async def list_workers() -> Response:
        return json_response({"urls": list(router.workers),
                              "workers": [w.info() for w in router.workers.values()]})

    @app.post("/add_worker")
    async def add_worker(url: str = "") -> Response:
        if not url:
            return error_response("pass the worker as a query parameter: /add_worker?url=URL",
                                  400)
        try:
            worker = await router.add_worker(url)
        except ValueError as e:
            return error_response(str(e), 400)
        except KeyError:
            return error_response(f"worker {url} is already in the router", 400)
        return json_response({"success": True, "message": f"Successfully added worker: {url}",
                              "worker": worker.info()})

    @app.post("/remove_worker")
    async def remove_worker(url: str = "") -> Response:
        if not url:
            return error_response("pass the worker as a query parameter: /remove_worker?url=URL",
                                  400)
        try:
            worker = router.remove_worker(url)
        except ValueError as e:
            return error_response(str(e), 400)
        except KeyError:
            return error_response(f"worker {url} is not in the router", 404)
        return json_response({"success": True,
                              "message": f"Successfully removed worker: {worker.url}"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(lambda: router.workers.values(), lambda: router.retries),
                        media_type=CONTENT_TYPE_LATEST)

    return app


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser(prog: str = "lockstep router") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Route requests across lockstep servers (the same HTTP API), "
        "by prefix affinity and load.",
        epilog="example:\n  lockstep router --worker-urls http://127.0.0.1:30001 "
        "http://127.0.0.1:30002 --port 30000",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    d = RouterConfig()
    p.add_argument("--worker-urls", nargs="*", default=[], metavar="URL",
                   help="Servers to route to (more can be added at run time: POST /add_worker).")
    p.add_argument("--policy", choices=POLICIES, default=d.policy, help="How a worker is picked.")
    p.add_argument("--host", default=d.host, help="Address to listen on.")
    p.add_argument("--port", type=int, default=d.port, help="Port to listen on.")
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: prefix match ratio above which the matching worker wins.")
    p.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="cache_aware: imbalanced when max - min load exceeds this ...")
    p.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="... and max load exceeds min load times this.")
    p.add_argument("--max-tree-size", type=int, default=d.max_tree_size,
                   help="cache_aware: characters kept per worker's tree (LRU eviction).")
    p.add_argument("--health-check-interval", type=float, default=d.health_check_interval,
                   help="Seconds between health checks of every worker.")
    p.add_argument("--health-check-timeout", type=float, default=d.health_check_timeout,
                   help="Seconds a worker's /health may take.")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="Seconds a request to a worker may take in all (default: no limit).")
    p.add_argument("--random-seed", type=int, default=d.random_seed,
                   help="Seed of the random and power_of_two policies.")
    p.add_argument("--log-level", default=d.log_level,
                   choices=["debug", "info", "warning", "error", "critical"])
    return p


def config_from_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> RouterConfig:
    cfg = RouterConfig(**{k: v for k, v in vars(ns).items()})
    try:
        cfg.worker_urls = [normalize_url(u) for u in cfg.worker_urls]
    except ValueError as e:
        parser.error(str(e))
    if not 0.0 <= cfg.cache_threshold <= 1.0:
        parser.error("--cache-threshold must be between 0 and 1")
    if cfg.health_check_interval <= 0 or cfg.health_check_timeout <= 0:
        parser.error("--health-check-interval and --health-check-timeout must be positive")
    if cfg.max_tree_size <= 0:
        parser.error("--max-tree-size must be positive")
    return cfg


def run_router(config: RouterConfig) -> None:
    import uvicorn

    from lockstep.utils.process import configure_logging

    configure_logging(config.log_level, "router")
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_config=None,
                log_level=config.log_level, access_log=config.log_level == "debug",
                timeout_keep_alive=30, timeout_graceful_shutdown=5)


def main(argv: Sequence[str] | None = None, prog: str = "lockstep router") -> int:
    parser = build_parser(prog)
    config = config_from_args(parser, parser.parse_args(
        list(sys.argv[1:] if argv is None else argv)))
    run_router(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())

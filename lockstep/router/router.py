"""The router: one process in front of several lockstep (or SGLang) servers, speaking their API.

    lockstep router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 \\
        --policy cache_aware --port 30000

- Generation routes go to the worker the policy picks (policies.py); streams are relayed as
  they arrive. An attempt that fails before anything reached the client (refused, reset, gone
  before its first byte, a 5xx) is retried on another worker, each at most once; after a byte
  it never is, so no request is answered twice (a cut stream ends with an SSE error, no [DONE]).
- Every `--health-check-interval` s each worker's /health is checked; a failing one leaves the
  rotation until it passes. /health is 200 while one worker is healthy; info, /tokenize and
  /detokenize come from one worker; /flush_cache and /abort_request go to all of them.
- Admin (SGLang router's names): POST /add_worker?url=URL, /remove_worker?url=URL,
  GET /list_workers, /get_router_info. The Authorization header is passed through unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from starlette.responses import Response

from lockstep.router.policies import POLICIES, Policy, make_policy
from lockstep.utils.asgi import SSE_HEADERS, DisconnectAwareStreamingResponse
from lockstep.utils.flags import below_min, flag
from lockstep.utils.http import error_body, error_response, sse

logger = logging.getLogger("lockstep.router")

_FORWARD_RESPONSE_HEADERS = ("content-type", "www-authenticate", "retry-after")
_RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def normalize_url(url: str) -> str:
    """`http://host:port` with no trailing slash, or ValueError saying what is wrong."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"worker URL {url!r} must look like http://HOST:PORT")
    return url


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
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "checked_at"}


@dataclass
class _Failure:
    """An attempt that failed before anything reached the client: retry elsewhere."""

    message: str
    response: Response | None = None  # the worker's own 5xx answer, if it gave one


@dataclass
class RouterConfig:
    """The router's options, and the table its command line is built from (utils/flags.py)."""

    worker_urls: list[str] = flag(
        [], "Servers to route to (more can be added at run time: POST /add_worker).", "router")
    policy: str = flag("cache_aware", "How a worker is picked.", "router", choices=POLICIES)
    host: str = flag("127.0.0.1", "Address to listen on.", "router")
    port: int = flag(30000, "Port to listen on.", "router")
    cache_threshold: float = flag(
        0.5, "cache_aware: prefix match ratio above which the matching worker wins.", "router",
        min=0)
    balance_abs_threshold: int = flag(
        32, "cache_aware: imbalanced when max - min load exceeds this ...", "router")
    balance_rel_threshold: float = flag(
        1.0001, "... and max load exceeds min load times this.", "router")
    max_tree_size: int = flag(
        2 ** 24, "cache_aware: characters kept per worker's tree (LRU eviction).", "router", min=1)
    health_check_interval: float = flag(
        5.0, "Seconds between health checks of every worker.", "router", min=0.001)
    health_check_timeout: float = flag(
        5.0, "Seconds a worker's /health may take.", "router", min=0.001)
    request_timeout: float | None = flag(
        None, "Seconds a request to a worker may take in all (default: no limit).", "router")
    random_seed: int | None = flag(
        0, "Seed of the random and power_of_two policies.", "router")
    log_level: str = flag("info", "Log level.", "router",
                          choices=["debug", "info", "warning", "error", "critical"])

    def __post_init__(self) -> None:
        problems = below_min(self)
        if self.cache_threshold > 1:
            problems.append("--cache-threshold must be <= 1")
        try:
            self.worker_urls = list(dict.fromkeys(normalize_url(u) for u in self.worker_urls))
        except ValueError as e:
            problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy: Policy = make_policy(
            config.policy, config.random_seed, cache_threshold=config.cache_threshold,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
            max_tree_size=config.max_tree_size)
        self.workers = {url: Worker(url) for url in config.worker_urls}
        self.session: aiohttp.ClientSession | None = None
        self.retries = 0
        self.requests = 0
        self._health_task: asyncio.Task[None] | None = None
        self._checks: dict[str, asyncio.Task[bool]] = {}

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

    async def dispatch(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                       pick: Callable[[list[Worker]], Worker]) -> Response:
        """Send the request to the worker `pick` chooses among the healthy ones, retrying on
        another while an attempt fails before anything reached the client."""
        tried: set[str] = set()
        last: _Failure | None = None
        while candidates := [w for w in self.healthy() if w.url not in tried]:
            worker = pick(candidates)
            tried.add(worker.url)
            if last is not None:
                self.retries += 1
                logger.info("retrying %s %s on %s after: %s", method, path, worker.url,
                            last.message)
            outcome = await self._attempt(worker, method, path, body, headers)
            if not isinstance(outcome, _Failure):
                return outcome
            worker.failed += 1
            last = outcome
        if last is None:
            return error_response("no healthy worker to serve the request", 503)
        if last.response is not None:
            return last.response
        return error_response(f"every worker failed; last: {last.message}", 502)

    async def _attempt(self, worker: Worker, method: str, path: str, body: bytes | None,
                       headers: dict[str, str]) -> Response | _Failure:
        """One try on `worker`; a _Failure (counted by `dispatch`) when another may be tried."""
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
                worker.last_error = f"{path} answered {resp.status}"
                failure = _Failure(f"{worker.url} answered {resp.status}")
                with contextlib.suppress(*_RETRYABLE):
                    failure.response = Response(await resp.read(), resp.status,
                                                headers=out_headers)
                return failure
            if resp.content_type == "text/event-stream":
                if not (first := await resp.content.readany()):
                    return _Failure(f"{worker.url} ended the stream before any event")
                handed_off = True
                return RelayResponse(self, worker, resp, first, {**out_headers, **SSE_HEADERS})
            data = await resp.read()
            worker.completed += 1
            return Response(data, resp.status, headers=out_headers)
        except aiohttp.ClientConnectorError as e:
            self.mark_unhealthy(worker, f"cannot connect: {e}")
            return _Failure(f"cannot connect to {worker.url}: {e}")
        except _RETRYABLE as e:
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


class RelayResponse(DisconnectAwareStreamingResponse):
    """A worker's stream passed on chunk by chunk. When it ends or the client leaves, the attempt
    ends (`on_close`, idempotent): load released, upstream closed — which aborts the request
    there if it was cut short."""

    def __init__(self, router: Router, worker: Worker, resp: aiohttp.ClientResponse,
                 first: bytes, headers: dict[str, str]) -> None:
        self.router, self.worker, self.resp = router, worker, resp
        self.closed = False
        super().__init__(self.chunks(first), resp.status, headers=headers)

    async def chunks(self, first: bytes) -> AsyncIterator[bytes]:
        tail = first
        try:
            yield first
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
            yield sep + sse(error_body(message, 502))
        finally:
            self.on_close()

    def on_close(self) -> None:
        if not self.closed:
            self.closed = True
            self.worker.load -= 1
            self.resp.close()

"""What every HTTP request passes before a route sees it: the connection limits (slow, idle and
surplus connections), the API key, the body-size limit, the server's phase (503 while it starts
or drains), and JSON parsing of bodies."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

import h11
import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from lockstep.entrypoints.chat_page import PAGE_PATHS
from lockstep.utils.asgi import BodyLimit
from lockstep.utils.http import error_body, error_response

RETRY_AFTER_S = 1
# /health, and the chat page with its files: the page must load to ask for the key.
_NO_AUTH_PATHS = frozenset({"/health", *PAGE_PATHS})
# Routes that start generations: refused with 503 while the server drains or is going down.
_GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions",
                               "/health_generate"})


class ServerStatus:
    """The front process's phase: starting -> ready -> draining; `dead` once a child died."""

    def __init__(self, launched: Any = None) -> None:
        self.phase = "starting"
        self.launched = launched  # a Launched: its `failed` says why a child died

    def unavailable(self) -> str | None:
        """Why the server takes no new requests now, or None when it does."""
        if self.launched is not None and self.launched.failed:
            return f"the server is going down: {self.launched.failed}"
        if self.phase == "starting":
            return "the server is starting; retry shortly"
        if self.phase == "draining":
            return "the server is shutting down; send new requests elsewhere"
        return None


def unavailable_response(message: str) -> Response:
    """A 503 with Retry-After: the server is starting, full, draining or going down."""
    resp = error_response(message, 503)
    resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the limits it lacks (300 clients that sent half their
    headers held 300 files of the front forever): a request must arrive whole within
    `read_timeout` s of its first byte (else 408 and close); a connection idle before its first
    request closes after the keep-alive timeout; one past `max_connections` gets a 503 with
    Retry-After and is closed. `limits()` makes the class for one server's values."""

    read_timeout: ClassVar[float] = 60.0
    max_connections: ClassVar[int | None] = None

    @classmethod
    def limits(cls, read_timeout: float, max_connections: int | None) -> type[BoundedH11Protocol]:
        return type(cls.__name__, (cls,), {"read_timeout": read_timeout,
                                           "max_connections": max_connections})

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        over = self.max_connections is not None and len(self.connections) >= self.max_connections
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        if over:
            refusal = unavailable_response(
                f"the server has {self.max_connections} connections open, its limit "
                "(--max-connections); retry shortly")
            refusal.headers["Connection"] = "close"
            self.app = refusal  # this connection's only request is answered by the refusal
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        reading = (self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
                   and not self.transport.is_closing())
        if reading and self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)
        elif not reading and self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        super().connection_lost(exc)

    def _read_timed_out(self) -> None:
        if not self.transport.is_closing() and (self.cycle is None
                                                or not self.cycle.response_started):
            body = orjson.dumps(error_body(
                f"the request did not arrive whole within {self.read_timeout:g} s "
                "(--timeout-request-read)", 408))
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
        self.transport.close()


class GuardMiddleware(BodyLimit):
    """The API key on every route but /health and the chat page, 503 (with Retry-After) on the generation routes
    while the server drains or goes down, and the body-size limit (BodyLimit)."""

    def __init__(self, app: Any, api_key: str | None, max_body: int,
                 status: ServerStatus | None = None) -> None:
        super().__init__(app, max_body)
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.status = status

    def _refusal(self, scope: Any, headers: dict[bytes, bytes]) -> Response | None:
        path = scope.get("path")
        if self.expected is not None and path not in _NO_AUTH_PATHS:
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                msg = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                       else "invalid API key")
                refusal = error_response(msg, 401)
                refusal.headers["WWW-Authenticate"] = "Bearer"
                return refusal
        refusal = super()._refusal(scope, headers)  # the Content-Length over the limit
        if refusal is None and self.status is not None and path in _GENERATION_PATHS:
            why = self.status.unavailable()
            refusal = unavailable_response(why) if why is not None else None
        return refusal


class JSONRequest(Request):
    """A body parsed by orjson: strict UTF-8, no NaN or Infinity, no lone surrogates, no numbers
    past 64 bits. Its errors are json.JSONDecodeError, which FastAPI turns into a 400."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class JSONRoute(APIRoute):
    """Routes whose bodies are JSON whatever the Content-Type says (`curl -d` declares a form)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            scope = dict(request.scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
            return await handler(JSONRequest(scope, request.receive))

        return route

"""What every HTTP request passes before a route sees it: the API key, the body-size limit, the
server's phase (503 while it starts or drains), and JSON parsing of bodies."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from lockstep.entrypoints.tokenizer_manager import RETRY_AFTER_S
from lockstep.utils.http import error_response

_NO_AUTH_PATHS = frozenset({"/health"})
# Routes that start generations: refused with 503 while the server drains or is going down.
_GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions",
                               "/health_generate"})


class ServerStatus:
    """The front process's phase: starting -> ready -> draining; `dead` once a child died."""

    def __init__(self, launched: Any = None) -> None:
        self.phase = "starting"
        self.launched = launched  # a Launched: its `failed` says why a child died

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


class GuardMiddleware:
    """Pure ASGI (streams and disconnects pass straight through): the API key on every route but
    /health, 503 (with Retry-After) on the generation routes while the server drains or goes
    down, and a body over `max_body` bytes refused with 413, whether its Content-Length says so
    or it is streamed in chunks. A body is read whole before the route runs; a client gone before
    its body arrived gets no answer."""

    def __init__(self, app: Any, api_key: str | None, max_body: int,
                 status: ServerStatus | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body = max_body
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
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return error_response(f"request body is {int(length)} bytes; the limit is "
                                  f"{self.max_body}", 413)
        if self.status is not None and path in _GENERATION_PATHS:
            why = self.status.unavailable()
            if why is not None:
                return unavailable_response(why)
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope, dict(scope.get("headers") or []))
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            chunks: list[bytes] = []
            size = 0
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # nobody to answer, nothing to log
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > self.max_body:
                    refusal = error_response(
                        f"request body exceeds the limit of {self.max_body} bytes", 413)
                    break
            else:
                receive = _replay(b"".join(chunks), receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _replay(body: bytes, receive: Any) -> Any:
    """`receive` that hands out `body` once, then whatever the client sends next (a disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


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

"""Work that stops the moment the client disconnects: one watcher for every route and stream;
and the request-body limit that the server and the router share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from lockstep.utils.http import error_response

T = TypeVar("T")


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Any, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnect once the client has gone (`work` is cancelled, which
    aborts the generation behind it). Starlette listens for the disconnect only below ASGI 2.4,
    else notices it on the next write: minutes away for a queued or non-streamed request."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()  # a no-op once it is done
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A stream cancelled as soon as the client disconnects. Closing the body iterator is what
    aborts the work behind it; `on_close` releases anything else."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            with contextlib.suppress(ClientDisconnect, OSError):  # OSError: gone mid-write
                await unless_disconnected(receive, self.stream_response(send))
        finally:
            with contextlib.suppress(Exception):  # AttributeError: nothing to close
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()

    def on_close(self) -> None:
        pass


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(DisconnectAwareStreamingResponse):
    """A server-sent-event stream; closing its body iterator is what aborts the work behind it."""

    def __init__(self, content: Any, status_code: int = 200) -> None:
        super().__init__(content, status_code, headers=SSE_HEADERS, media_type="text/event-stream")


class BodyLimit:
    """Pure ASGI middleware: a body over `max_body` bytes gets 413, by its Content-Length or as
    it streams in; a body is read whole before the route runs. Subclasses refuse more in
    `_refusal`."""

    def __init__(self, app: Any, max_body: int) -> None:
        self.app = app
        self.max_body = max_body

    def _refusal(self, scope: Any, headers: dict[bytes, bytes]) -> Response | None:
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return error_response(f"request body is {int(length)} bytes; the limit is "
                                  f"{self.max_body}", 413)
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
        await (refusal if refusal is not None else self.app)(scope, receive, send)


def _replay(body: bytes, receive: Any) -> Any:
    """`receive` that hands out `body` once, then whatever the client sends next (a disconnect)."""
    first = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, Any]:
        return first.pop() if first else await receive()

    return replay

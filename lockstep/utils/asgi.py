"""Work that stops the moment the client disconnects: one watcher for every route and stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

T = TypeVar("T")


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Any, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnect once the client has gone: `work` is cancelled then,
    which is what aborts the generation (or the upstream request) behind it. Watched here
    whatever ASGI spec version the server speaks: Starlette only listens for the disconnect
    below 2.4 and otherwise notices it on the next write, which for a queued request or a
    non-streamed one may be minutes away while its KV stays held."""
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

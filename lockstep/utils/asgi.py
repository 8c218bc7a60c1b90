"""Streaming responses that stop the moment the client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.responses import StreamingResponse


async def wait_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Cancelled as soon as the client disconnects, whatever ASGI spec version the server speaks
    (Starlette only listens for the disconnect below 2.4, and otherwise notices it on the next
    write, which for a queued request may be a long time away). Closing the body iterator is
    what aborts the work behind it; `on_close` releases anything else."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
            self.on_close()

    def on_close(self) -> None:
        pass

    async def _stream(self, send: Any) -> None:
        with contextlib.suppress(OSError):  # the client went away mid-write
            await self.stream_response(send)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(DisconnectAwareStreamingResponse):
    """A server-sent-event stream; closing its body iterator is what aborts the work behind it."""

    def __init__(self, content: Any, status_code: int = 200) -> None:
        super().__init__(content, status_code, headers=SSE_HEADERS, media_type="text/event-stream")

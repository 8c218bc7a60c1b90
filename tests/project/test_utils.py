"""lockstep.utils: the cache root, SSE framing, and the client-disconnect watcher."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from lockstep.utils.asgi import unless_disconnected
from lockstep.utils.cache import cache_dir
from lockstep.utils.http import SSE_DONE, sse


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux layout")
def test_the_cache_stays_in_dot_cache_lockstep_on_linux(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCKSTEP_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir("kernels") == tmp_path / ".cache" / "lockstep" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lockstep"


def test_lockstep_cache_dir_overrides_the_platforms_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir("tiny") == Path(tmp_path / "mine" / "tiny")


class _Chunk(BaseModel):
    text: str


def test_sse_events_are_the_bytes_openai_clients_and_sglangs_router_parse():
    assert sse({"text": "a\nb", "n": [1, 2]}) == b'data: {"text":"a\\nb","n":[1,2]}\n\n'
    assert sse(_Chunk(text="hi")) == b'data: {"text":"hi"}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


def _receive(disconnect_after: float):
    async def receive() -> dict:
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}
    return receive


def test_work_that_ends_first_gives_its_result_or_its_error():
    async def work() -> int:
        await asyncio.sleep(0.01)
        return 7

    async def fails() -> None:
        raise ValueError("bad input")

    assert asyncio.run(unless_disconnected(_receive(10), work())) == 7
    with pytest.raises(ValueError, match="bad input"):
        asyncio.run(unless_disconnected(_receive(10), fails()))


def test_a_disconnect_cancels_the_work_and_raises_client_disconnect():
    cancelled = []

    async def work() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)  # where a generation is aborted and its KV freed
            raise

    with pytest.raises(ClientDisconnect):
        asyncio.run(unless_disconnected(_receive(0.01), work()))
    assert cancelled == [True]

"""The chat page at `/`: plain HTML, CSS and JavaScript from `static/` (package data), served by
lockstep itself so that it works offline. The page talks to the server's own
/v1/chat/completions, streamed; closing or stopping a reply disconnects, and the server aborts the
request. The page and its files load without the API key (GuardMiddleware lets PAGE_PATHS
through): with --api-key the page asks for the key and sends it as a Bearer token."""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import APIRouter, HTTPException
from starlette.responses import Response

STATIC = Path(__file__).with_name("static")
# URL path -> (file in STATIC, media type)
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
PAGE_PATHS = frozenset(_FILES)
# Everything the page loads comes from this server: a page edited to pull from a CDN fails here,
# not on a machine without the internet.
_HEADERS = {"Content-Security-Policy": "default-src 'self'", "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff"}

router = APIRouter()


@functools.cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def _serve(path: str) -> Response:
    if path not in _FILES:
        raise HTTPException(404, f"no page file {path}")
    name, media_type = _FILES[path]
    return Response(_read(name), media_type=media_type, headers=_HEADERS)


# Not in /openapi.json: a page for people, not part of the API.
@router.get("/", include_in_schema=False)
async def index() -> Response:
    return _serve("/")


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> Response:
    return _serve(f"/static/{name}")

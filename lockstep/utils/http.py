"""HTTP responses shared by the server and the router: JSON, OpenAI's error shape, SSE events."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.sse import format_sse_event
from pydantic import BaseModel
from starlette.responses import Response


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": ErrorDetail(message=message, type=kind, param=param, code=status).model_dump()}


def _default(value: Any) -> Any:
    if isinstance(value, tuple):  # a NamedTuple (a TokenLogprob): a JSON array, as a tuple is
        return tuple(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, default=_default)


def json_response(content: Any, status: int = 200) -> Response:
    return Response(dumps(content), status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400, param: str | None = None) -> Response:
    return json_response(error_body(message, status, param), status)


def sse(data: Any) -> bytes:
    """One server-sent event (FastAPI's framing: `data: ...` and a blank line); `data` is a dict,
    a pydantic model, or a preformatted string such as "[DONE]"."""
    if isinstance(data, BaseModel):
        data = data.model_dump()
    return format_sse_event(data_str=data if isinstance(data, str) else dumps(data).decode())


SSE_DONE = sse("[DONE]")

"""Every error the HTTP server sends, in OpenAI's shape ({"error": {"message", "type", "param",
"code"}}): a request that fails validation gets a 400 with one sentence naming each bad field."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from lockstep.entrypoints.generate_request import UNION_TAGS
from lockstep.entrypoints.middleware import unavailable_response
from lockstep.entrypoints.tokenizer_manager import RequestError
from lockstep.utils.http import error_response

logger = logging.getLogger(__name__)


_MESSAGES: dict[str, str] = {
    "missing": "is required",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    **dict.fromkeys(("extra_forbidden", "unexpected_keyword_argument"),
                    "unknown field (not supported by this server)"),
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "must be an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "must be a number"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "must be a boolean"),
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type", "dataclass_type"),
                    "must be an object"),
}


def _num(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _describe(err: Mapping[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
              "less_than": "<"}
    if kind in bounds:
        return f"must be {bounds[kind]} {_num(next(iter(ctx.values())))}"
    if kind in ("too_short", "string_too_short"):
        n = ctx.get("min_length", 1)
        return "must not be empty" if n == 1 else f"must have at least {n} items"
    if kind in ("too_long", "string_too_long"):
        unit = "characters" if kind == "string_too_long" else "items"
        return f"must have at most {ctx.get('max_length')} {unit}"
    if kind == "union_tag_invalid":
        return f"has type {ctx.get('tag')!r}; only {ctx.get('expected_tags')} parts are supported"
    if kind == "union_tag_not_found":
        return f"must have a {ctx.get('discriminator')} field"
    if kind == "literal_error":
        return f"must be {ctx.get('expected')}"
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    return _MESSAGES.get(kind, err["msg"])


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in UNION_TAGS and "[" not in part:
            out += f".{part}" if out else part
    return out


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """One sentence naming each bad field, e.g. "sampling_params.temperature: must be >= 0, got -1"."""
    return format_errors(exc.errors(include_url=False))


def format_errors(errors: Sequence[Mapping[str, Any]], max_errors: int = 5) -> str:
    parts = []
    for err in errors[:max_errors]:
        text = _describe(err)
        value = err.get("input")
        if err["type"] not in ("missing", "extra_forbidden", "unexpected_keyword_argument") \
                and isinstance(value, (str, int, float)):
            shown = (repr(value[:40] + "..." if len(value) > 40 else value)
                     if isinstance(value, str) else str(value))
            text += f", got {shown}"
        where = _where(tuple(err["loc"]))
        if not where and err["type"] in ("model_type", "dict_type", "model_attributes_type"):
            where = "request body"
        parts.append(f"{where}: {text}" if where else text)
    if len(errors) > max_errors:
        parts.append(f"and {len(errors) - max_errors} more errors")
    return "; ".join(parts)


def _body_error(errors: Sequence[Mapping[str, Any]]) -> str | None:
    """The body itself is not JSON (FastAPI's `json_invalid`) or is missing."""
    for err in errors:
        if err["type"] == "json_invalid":
            return f"request body is not valid JSON: {(err.get('ctx') or {}).get('error', '')}"
        if err["type"] == "missing" and tuple(err["loc"]) == ("body",):
            return "request body is empty; send a JSON object"
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if (message := _body_error(errors)) is None:
            # FastAPI prefixes every location with "body"; the field paths start below it.
            errors = [{**e, "loc": tuple(e["loc"])[1:]} for e in errors]
            message = format_errors(errors)
        return error_response(message, 400)

    @app.exception_handler(pydantic.ValidationError)
    async def _model_invalid(_req: Request, exc: pydantic.ValidationError) -> Response:
        return error_response(format_validation_error(exc), 400)

    @app.exception_handler(RequestError)
    async def _request_error(_req: Request, exc: RequestError) -> Response:
        if exc.status == 503:
            return unavailable_response(str(exc))
        return error_response(str(exc), exc.status)

    @app.exception_handler(ClientDisconnect)  # before its (non-streamed) response was ready
    async def _client_gone(_req: Request, _exc: ClientDisconnect) -> Response:
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> Response:
        message = {404: f"no route {req.url.path}",
                   405: f"method {req.method} is not allowed on {req.url.path}"}
        resp = error_response(message.get(exc.status_code, str(exc.detail)), exc.status_code)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(Exception)
    async def _internal_error(req: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s %s", req.method, req.url.path)
        # The exception's text stays in the log: it may carry internal state (a grammar engine's
        # parser dump once reached clients this way).
        return error_response(f"internal server error ({type(exc).__name__}); the server log "
                              "has the details", 500)

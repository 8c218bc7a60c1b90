"""An incremental scanner for one call written as {"name": ..., "arguments": {...}} (Qwen2.5/3 in
<tool_call> tags, Llama 3.x with "parameters"). The call is announced once its name is a tool's
and its arguments have begun; they then stream as the model's own text, so their concatenation is
exactly the JSON it wrote. The json library decodes the values (`decode_at`); this module only
reads the call's shape around them."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum
from typing import Any

import pydantic_core

ARGUMENT_KEYS = frozenset({"arguments", "parameters"})
_WS = " \t\r\n"
# The scanner's phases that read one punctuation character: those allowed, and the next phase.
_PUNCTUATION = {"open": {"{": "key_or_end"}, "colon": {":": "value"},
                "after_value": {",": "key", "}": "close"}}


class Status(Enum):
    MORE = "more"  # needs more text
    DONE = "done"  # the object closed at `end`
    FAILED = "failed"  # not a call of this shape (before or after it was announced)


_DECODER = json.JSONDecoder()


def skip_ws(buf: str, i: int) -> int:
    """The first index at or after `i` that is not JSON whitespace (len(buf) if none)."""
    while i < len(buf) and buf[i] in _WS:
        i += 1
    return i


def decode_at(buf: str, i: int) -> tuple[Any, int] | None:
    """The JSON value at `buf[i]` and the index past it, None while the text ends inside it, or
    ValueError once no text can make it JSON (raw_decode, and pydantic_core's partial parser)."""
    try:
        return _DECODER.raw_decode(buf, i)
    except RecursionError as e:  # a model may nest brackets past the interpreter's stack
        raise ValueError("JSON nested too deeply") from e
    except json.JSONDecodeError:
        pydantic_core.from_json(buf[i:], allow_partial="trailing-strings")
        return None


class JsonCallScanner:
    """Scans `buf` from `start`; `advance` is called again as `buf` grows."""

    def __init__(self, tool_names: frozenset[str], start: int,
                 on_start: Callable[[str], None], on_arguments: Callable[[str], None]) -> None:
        self.tool_names = tool_names
        self.i = start
        self.end = start
        self.on_start = on_start
        self.on_arguments = on_arguments
        self.announced = False
        self._phase = "open"
        self._key: str | None = None
        self._seen: set[str] = set()
        self._name: str | None = None
        self._args: str | None = None  # the complete arguments text, once known
        self._args_start = self._args_sent = self._args_seen = 0

    def advance(self, buf: str, final: bool) -> Status:
        while True:
            try:
                status = self._advance_once(buf)
            except ValueError:  # from decode_at: not JSON, whatever follows
                return Status.FAILED
            if status is Status.MORE and final:
                return Status.FAILED  # the text ended inside the object
            if status is not None:
                return status

    def _advance_once(self, buf: str) -> Status | None:
        phase = self._phase
        if phase == "arguments":
            return self._scan_arguments(buf)
        if phase == "close":
            return self._close()
        self.i = skip_ws(buf, self.i)
        if self.i == len(buf):
            return Status.MORE
        c = buf[self.i]
        if phase in _PUNCTUATION:
            if c not in _PUNCTUATION[phase]:
                return Status.FAILED
            self.i += 1
            self._phase = _PUNCTUATION[phase][c]
        elif phase in ("key", "key_or_end"):
            if c == "}" and phase == "key_or_end":
                self.i += 1
                self._phase = "close"
                return None
            if c != '"':
                return Status.FAILED
            if (decoded := decode_at(buf, self.i)) is None:
                return Status.MORE
            key, self.i = decoded
            if key in self._seen or key not in ARGUMENT_KEYS | {"name", "type"}:
                return Status.FAILED
            self._seen.add(key)
            self._key = key
            self._phase = "colon"
        elif phase == "value":
            return self._value(buf, c)
        return None

    def _value(self, buf: str, c: str) -> Status | None:
        key = self._key
        if key in ARGUMENT_KEYS:
            if c != "{":
                return Status.FAILED
            self._args_start = self._args_sent = self._args_seen = self.i
            self._phase = "arguments"
            if self._name is not None:
                self._announce()
            return None
        if c != '"':
            return Status.FAILED
        if (decoded := decode_at(buf, self.i)) is None:
            return Status.MORE  # decoded again once complete (names are short)
        value, self.i = decoded
        self._phase = "after_value"
        if key == "type":
            return None if value == "function" else Status.FAILED
        if value not in self.tool_names:
            return Status.FAILED
        self._name = value
        if self._args is not None:
            self._announce()
            self.on_arguments(self._args)
        return None

    def _announce(self) -> None:
        self.announced = True
        self.on_start(self._name or "")

    def _scan_arguments(self, buf: str) -> Status | None:
        """The arguments object (it opens with "{"): streamed as the model's text while it
        grows, once the call is announced; kept whole until then."""
        # An object can only end at a "}": decoding only when one arrived keeps a long argument
        # linear-ish (decoding the whole buffer at every 3-character piece is quadratic in it).
        closing = "}" in buf[self._args_seen:]
        self._args_seen = len(buf)
        decoded = decode_at(buf, self._args_start) if closing else None
        end = len(buf) if decoded is None else decoded[1]
        if self.announced:
            self.on_arguments(buf[self._args_sent:end])
            self._args_sent = end
        if decoded is None:
            return Status.MORE
        self.i = end
        if not self.announced:
            self._args = buf[self._args_start:end]
        self._phase = "after_value"
        return None

    def _close(self) -> Status:
        if self._name is None:
            return Status.FAILED
        if not self.announced:
            self._announce()
            self.on_arguments(self._args if self._args is not None else "{}")
        self.end = self.i
        return Status.DONE

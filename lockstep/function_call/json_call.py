"""An incremental scanner for one call written as a JSON object: {"name": ..., "arguments": {...}}.

Qwen2.5/3 (inside <tool_call> tags) and Llama 3.x (bare, or after <|python_tag|>) both write calls
this way; Llama says "parameters" where Qwen says "arguments", and either is accepted. The call
is announced once its name is known to be one of the tools and its arguments object has begun;
the arguments then stream as the model's own text, piece by piece, so that their concatenation is
exactly the JSON the model wrote.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum

ARGUMENT_KEYS = frozenset({"arguments", "parameters"})
_WS = " \t\r\n"


class Status(Enum):
    MORE = "more"  # needs more text
    DONE = "done"  # the object closed at `end`
    FAILED = "failed"  # not a call of this shape (before or after it was announced)


def string_end(text: str, start: int) -> int | None:
    """Index just past the JSON string that opens at `text[start]` (a quote), or None if the
    text ends first."""
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
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
        self._args_start = 0
        self._args_sent = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def advance(self, buf: str, final: bool) -> Status:
        while True:
            status = self._advance_once(buf)
            if status is Status.MORE and final:
                return Status.FAILED  # the text ended inside the object
            if status is not None:
                return status

    def _skip_ws(self, buf: str) -> bool:
        while self.i < len(buf) and buf[self.i] in _WS:
            self.i += 1
        return self.i < len(buf)

    def _advance_once(self, buf: str) -> Status | None:
        phase = self._phase
        if phase == "arguments":
            return self._scan_arguments(buf)
        if phase == "close":
            return self._close()
        if not self._skip_ws(buf):
            return Status.MORE
        c = buf[self.i]
        if phase == "open":
            if c != "{":
                return Status.FAILED
            self.i += 1
            self._phase = "key_or_end"
        elif phase in ("key", "key_or_end"):
            if c == "}" and phase == "key_or_end":
                self.i += 1
                self._phase = "close"
                return None
            if c != '"':
                return Status.FAILED
            end = string_end(buf, self.i)
            if end is None:
                return Status.MORE
            key = json.loads(buf[self.i:end])
            if key in self._seen or key not in ARGUMENT_KEYS | {"name", "type"}:
                return Status.FAILED
            self._seen.add(key)
            self._key = key
            self.i = end
            self._phase = "colon"
        elif phase == "colon":
            if c != ":":
                return Status.FAILED
            self.i += 1
            self._phase = "value"
        elif phase == "value":
            return self._value(buf, c)
        elif phase == "after_value":
            if c not in ",}":
                return Status.FAILED
            self.i += 1
            self._phase = "key" if c == "," else "close"
        return None

    def _value(self, buf: str, c: str) -> Status | None:
        key = self._key
        if key in ARGUMENT_KEYS:
            if c != "{":
                return Status.FAILED
            self._args_start = self._args_sent = self.i
            self._depth = 0
            self._phase = "arguments"
            if self._name is not None:
                self._announce()
            return None
        if c != '"':
            return Status.FAILED
        end = string_end(buf, self.i)
        if end is None:
            return Status.MORE  # the string is scanned again once complete (names are short)
        value = json.loads(buf[self.i:end])
        self.i = end
        self._phase = "after_value"
        if key == "type":
            return None if value == "function" else Status.FAILED
        if not isinstance(value, str) or value not in self.tool_names:
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
        i, depth, in_string, escape = self.i, self._depth, self._in_string, self._escape
        done = False
        while i < len(buf):
            c = buf[i]
            i += 1
            if in_string:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    done = True
                    break
        self.i, self._depth, self._in_string, self._escape = i, depth, in_string, escape
        if self.announced:
            self.on_arguments(buf[self._args_sent:i])
            self._args_sent = i
        if not done:
            return Status.MORE
        text = buf[self._args_start:i]
        try:
            valid = isinstance(json.loads(text), dict)
        except ValueError:
            valid = False
        if not valid:
            return Status.FAILED
        if not self.announced:
            self._args = text
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

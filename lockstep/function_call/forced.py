"""Parsers for the formats a grammar forces when a call is required, not the model's own.

With tool_choice "required" the output is constrained to a JSON array of calls,
[{"name": ..., "arguments": {...}}, ...]; with a named function it is constrained to that
function's arguments object alone. Either way the grammar fixes the shape, so these parsers
stream calls the same way the model-format parsers do, from the same base."""

from __future__ import annotations

import json
from collections.abc import Iterable

from lockstep.function_call.core import ToolCallParser
from lockstep.function_call.json_call import Status


class CallArrayParser(ToolCallParser):
    """[{"name": ..., "arguments": {...}}, ...] and nothing else."""

    name = "call_array"

    def _step(self, final: bool) -> bool:
        if self._mode == "block":
            status = self._advance_json_call(final)
            if status is Status.MORE:
                return False
            self._malformed |= status is Status.FAILED
            self._mode = "broken" if status is Status.FAILED else "next"
            return True
        rest = self._buf[self._pos:]
        stripped = rest.lstrip()
        if self._mode == "broken":
            self._pos = len(self._buf)
            return False
        if not stripped:
            if final and self._mode != "done":  # the text ended inside the array
                self._mode = "broken"
                self._malformed = True
            return False
        expected = {"start": "[", "first": "{]", "next": ",]"}.get(self._mode)
        if expected is None or stripped[0] not in expected:
            self._malformed = True
            self._mode = "broken"
            return True
        self._pos += len(rest) - len(stripped) + 1
        if stripped[0] == "[":
            self._mode = "first"
        elif stripped[0] == "]":
            self._malformed = not self._calls  # an empty array is not a call
            self._mode = "broken" if self._malformed else "done"
        elif stripped[0] == "{":
            self._open_json_call(self._pos - 1)
        else:  # ","
            self._open_json_call(self._pos)
        return True


class NamedArgumentsParser(ToolCallParser):
    """The arguments object of one call to a function named in advance."""

    name = "named_arguments"

    def __init__(self, tool_names: Iterable[str]) -> None:
        names = sorted(tool_names)
        if len(names) != 1:
            raise ValueError("a named-function parser takes exactly one function name")
        super().__init__(names)
        self._function = names[0]

    def _step(self, final: bool) -> bool:
        if not self._calls:
            self._start_call(self._function)
        piece = self._buf[self._pos:]
        self._pos = len(self._buf)
        self._arguments(piece)
        if final:
            self._end_call(ok=_is_object("".join(self._calls[0][2:])))
        return False


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # a model may nest brackets past the interpreter's stack
        return False

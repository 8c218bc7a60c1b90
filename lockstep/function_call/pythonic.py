"""Pythonic calls, as Llama 3.2/4 and others write them: [get_weather(city="Paris"), f(n=1)].

The list is the whole reply (possibly after whitespace). Keyword values are Python literals; each
becomes JSON as soon as it is complete, so a call's `arguments` stream one argument at a time."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable

from lockstep.function_call.core import ToolCallParser
from lockstep.function_call.json_call import skip_ws

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_OPEN, _CLOSE = "([{", ")]}"


def literal_json(text: str) -> str | None:
    """A Python literal's JSON text, or None if it is not a literal JSON can hold."""
    try:
        return json.dumps(ast.literal_eval(text.strip()), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


class PythonicParser(ToolCallParser):
    name = "pythonic"

    def __init__(self, tool_names: Iterable[str]) -> None:
        super().__init__(tool_names)
        self._list_start = 0
        self._phase = "name"
        self._keys: list[str] = []
        self._value_start = 0
        self._depth = 0
        self._quote = ""
        self._escape = False

    def _step(self, final: bool) -> bool:
        rest = self._buf[self._pos:]
        if self._mode == "start":
            stripped = rest.lstrip()
            if not stripped and not final:
                return False
            if stripped.startswith("["):
                self._content(rest[:len(rest) - len(stripped)])
                self._list_start = self._pos + len(rest) - len(stripped)
                self._pos = self._list_start + 1
                self._mode = "list"
            else:
                self._mode = "content"
            return True
        if self._mode == "list":
            ok = self._list_step()
            if ok is None:
                if not final:
                    return False
                ok = False  # the text ended inside the list
            if not ok:
                self._fail()
            return True
        if self._mode == "content":
            self._content(rest)
        self._pos = len(self._buf)  # all taken: as content, or as the rest of a broken list
        return False

    def _fail(self) -> None:
        if self._calls:  # announced calls cannot be taken back; the list is unusable
            self._end_call(ok=False)
            self._mode = "discard"
        else:  # not a call list: the "[" is text, and so is the rest
            self._content("[")
            self._pos = self._list_start + 1
            self._mode = "content"

    def _list_step(self) -> bool | None:
        """One move inside the list: True on progress, None when more text is needed, False
        when the text is not a call list."""
        if self._phase == "value":
            return self._scan_value()
        self._pos = skip_ws(self._buf, self._pos)
        if self._pos == len(self._buf):
            return None
        buf, pos, phase = self._buf, self._pos, self._phase
        if phase in ("name", "key_or_close"):
            if phase == "key_or_close" and buf[pos] == ")":
                self._arguments("}" if self._keys else "{}")
                self._end_call(ok=True)
                self._pos += 1
                self._phase = "after_call"
                return True
            if (m := _IDENT.match(buf, pos)) is None:
                return False
            j = skip_ws(buf, m.end())
            if j == len(buf):
                return None  # the identifier may go on
            if phase == "name":
                if m.group() not in self.tool_names or buf[j] != "(":
                    return False
                self._pos = j + 1
                self._keys = []
                self._start_call(m.group())
                self._phase = "key_or_close"
            else:
                if m.group() in self._keys:
                    return False
                self._keys.append(m.group())
                self._pos = j
                self._phase = "equals"
            return True
        if phase == "equals":
            if buf[pos] != "=":
                return False
            self._pos += 1
            self._value_start = self._pos
            self._depth, self._quote, self._escape = 0, "", False
            self._phase = "value"
            return True
        # "after_call": another call or the end of the list
        if buf[pos] not in ",]":
            return False
        self._pos += 1
        if buf[pos] == ",":
            self._phase = "name"
        else:
            self._mode = "content"  # what follows the list is content
        return True

    def _scan_value(self) -> bool | None:
        """Where a keyword's value ends (a "," or ")" outside brackets and quotes). Hand-written:
        the values are Python literals ('single quotes', True, None: test_tool_parsers'
        PYTHONIC_TWO), which no JSON parser reads, and ast reads only a complete expression
        (it does the decoding, in literal_json, once the end is found)."""
        buf, i = self._buf, self._pos
        depth, quote, escape = self._depth, self._quote, self._escape
        end = -1
        while i < len(buf):
            c = buf[i]
            if quote:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == quote:
                    quote = ""
            elif c in "'\"":
                quote = c
            elif c in _OPEN:
                depth += 1
            elif c in _CLOSE and depth:
                depth -= 1
            elif c in ",)" and depth == 0:
                end = i
                break
            i += 1
        self._pos, self._depth, self._quote, self._escape = i, depth, quote, escape
        if end < 0:
            return None
        if (value := literal_json(buf[self._value_start:end])) is None:
            return False
        opener = "{" if len(self._keys) == 1 else ", "
        self._arguments(f"{opener}{json.dumps(self._keys[-1], ensure_ascii=False)}: {value}")
        self._pos = end + 1
        if buf[end] == ")":
            self._arguments("}")
            self._end_call(ok=True)
            self._phase = "after_call"
        else:
            self._phase = "key_or_close"
        return True

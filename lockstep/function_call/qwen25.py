"""Qwen2.5 / Qwen3 (and Hermes-style) calls: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.

Text before the first tag is content; several tagged blocks are several calls.
"""

from __future__ import annotations

from collections.abc import Iterable

from lockstep.function_call.core import ToolCallParser, partial_suffix
from lockstep.function_call.json_call import Status

START = "<tool_call>"
END = "</tool_call>"


class Qwen25Parser(ToolCallParser):
    name = "qwen25"

    def __init__(self, tool_names: Iterable[str]) -> None:
        super().__init__(tool_names)
        self._mode = "content"
        self._block_start = 0

    def _step(self, final: bool) -> bool:
        rest = self._buf[self._pos:]
        if self._mode == "content":
            i = rest.find(START)
            if i < 0:
                n = len(rest) - (0 if final else partial_suffix(rest, START))
                self._content(rest[:n])
                self._pos += n
                return False
            self._content(rest[:i])
            self._block_start = self._pos + i
            self._open_json_call(self._block_start + len(START))
            self._mode = "block"
            return True
        if self._mode == "block":
            return self._block(final)
        if self._mode == "block_end":
            stripped = rest.lstrip()
            if stripped.startswith(END):
                self._pos += len(rest) - len(stripped) + len(END)
            elif not final and END.startswith(stripped):
                return False  # maybe the closing tag, still arriving
            # A missing closing tag does not undo a complete call; what follows is content.
            self._mode = "content"
            return True
        # "discard": the rest of a broken call, up to its closing tag
        i = rest.find(END)
        if i >= 0:
            self._pos += i + len(END)
            self._mode = "content"
            return True
        self._pos += len(rest) - (0 if final else partial_suffix(rest, END))
        return False

    def _block(self, final: bool) -> bool:
        status = self._advance_json_call(final)
        if status is Status.MORE:
            return False
        if status is Status.DONE:
            self._mode = "block_end"
        elif self._scanner is not None and self._scanner.announced:
            self._pos = self._scanner.i
            self._mode = "discard"
        else:  # not a call after all: the tag is text, and scanning resumes after it
            self._content(START)
            self._pos = self._block_start + len(START)
            self._mode = "content"
        return True

"""Llama 3.1 / 3.2 / 3.3 JSON calls: {"name": ..., "parameters": {...}}, several joined by ";".

The calls are the whole reply (possibly after whitespace), or follow <|python_tag|> (when the
detokenizer keeps special tokens), in which case text before the tag is content.
"""

from __future__ import annotations

from collections.abc import Iterable

from lockstep.function_call.core import ToolCallParser, partial_suffix
from lockstep.function_call.json_call import Status

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolCallParser):
    name = "llama3"

    def __init__(self, tool_names: Iterable[str]) -> None:
        super().__init__(tool_names)
        self._mode = "start"
        self._block_start = 0
        self._marker_len = 0

    def _open_block(self, at: int, marker_len: int) -> None:
        self._block_start = at
        self._marker_len = marker_len
        self._open_json_call(at + marker_len)
        self._mode = "block"

    def _step(self, final: bool) -> bool:
        rest = self._buf[self._pos:]
        stripped = rest.lstrip()
        if self._mode == "start":
            if not stripped and not final:
                return False
            if stripped.startswith("{"):
                self._content(rest[:len(rest) - len(stripped)])
                self._open_block(self._pos + len(rest) - len(stripped), 0)
            else:
                self._mode = "content"
            return True
        if self._mode == "content":
            i = rest.find(PYTHON_TAG)
            if i < 0:
                n = len(rest) - (0 if final else partial_suffix(rest, PYTHON_TAG))
                self._content(rest[:n])
                self._pos += n
                return False
            self._content(rest[:i])
            self._open_block(self._pos + i, len(PYTHON_TAG))
            return True
        if self._mode == "block":
            return self._block(final)
        if self._mode == "after":
            return self._after(rest, stripped, final)
        self._pos = len(self._buf)  # "discard": the rest of a broken call
        return False

    def _block(self, final: bool) -> bool:
        status = self._advance_json_call(final)
        if status is Status.MORE:
            return False
        if status is Status.DONE:
            self._mode = "after"
        elif self._scanner is not None and self._scanner.announced:
            self._mode = "discard"
        else:  # not a call: its first character (or the tag) is text
            n = max(1, self._marker_len)
            self._content(self._buf[self._block_start:self._block_start + n])
            self._pos = self._block_start + n
            self._mode = "content"
        return True

    def _after(self, rest: str, stripped: str, final: bool) -> bool:
        """After a call: ";" and another call, or the end of the calls."""
        if not stripped.startswith(";"):
            if not stripped and not final:
                return False
            self._mode = "content"
            return True
        following = stripped[1:].lstrip()
        if not following and not final:
            return False
        if following.startswith("{"):
            self._open_block(len(self._buf) - len(following), 0)
        elif not following:
            self._pos = len(self._buf)  # a trailing ";" belongs to the calls
        else:
            self._mode = "content"
        return True

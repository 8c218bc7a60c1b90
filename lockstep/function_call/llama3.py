"""Llama 3.1 / 3.2 / 3.3 JSON calls: {"name": ..., "parameters": {...}}, several joined by ";".

The calls are the whole reply (possibly after whitespace), or follow <|python_tag|> (when the
detokenizer keeps special tokens), in which case text before the tag is content."""

from __future__ import annotations

from lockstep.function_call.core import ToolCallParser

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolCallParser):
    name = "llama3"

    def _step(self, final: bool) -> bool:
        rest = self._buf[self._pos:]
        stripped = rest.lstrip()
        if self._mode == "start":
            if not stripped and not final:
                return False
            if stripped.startswith("{"):
                self._content(rest[:len(rest) - len(stripped)])
                self._open_json_call(self._pos + len(rest) - len(stripped))
            else:
                self._mode = "content"
            return True
        if self._mode == "content":
            return self._content_until(PYTHON_TAG, final)
        if self._mode == "block":
            return self._json_block(final, "after")
        if self._mode == "after":
            return self._after(stripped, final)
        self._pos = len(self._buf)  # "discard": the rest of a broken call
        return False

    def _after(self, stripped: str, final: bool) -> bool:
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
            self._open_json_call(len(self._buf) - len(following))
        elif not following:
            self._pos = len(self._buf)  # a trailing ";" belongs to the calls
        else:
            self._mode = "content"
        return True

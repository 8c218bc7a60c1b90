"""Qwen2.5 / Qwen3 (and Hermes-style) calls: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.

Text before the first tag is content; several tagged blocks are several calls."""

from __future__ import annotations

from lockstep.function_call.core import ToolCallParser, partial_suffix

START = "<tool_call>"
END = "</tool_call>"


class Qwen25Parser(ToolCallParser):
    name = "qwen25"

    def _step(self, final: bool) -> bool:
        rest = self._buf[self._pos:]
        if self._mode in ("start", "content"):
            return self._content_until(START, final)
        if self._mode == "block":
            return self._json_block(final, "block_end")
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

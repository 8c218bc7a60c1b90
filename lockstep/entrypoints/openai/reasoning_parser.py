"""Reasoning models' thinking blocks, by SGLang's --reasoning-parser names: a reply
`[<think>] reasoning </think> content` in, `reasoning_content` and `content` out. Whether it
starts inside the block is known before the first token (the format always thinks, the prompt
ends with the start marker, or Qwen3's enable_thinking is not false); otherwise only a block the
reply starts with counts. As the tool-call parsers do, a stream holds back what may be the start
of a marker; `parse` runs the same machine over a whole text."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep.function_call.core import partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    always: bool = False  # reasoning from the first token, whatever the request says
    toggle: str | None = None  # the chat_template_kwargs key whose false turns thinking off
    tool_start: str | None = None  # a tool call that ends the block without its end marker

    def starts_inside(self, chat_template_kwargs: Mapping[str, Any] | None, prompt: str) -> bool:
        kwargs = chat_template_kwargs or {}
        return (self.always or prompt.rstrip().endswith(self.start)
                or (self.toggle is not None and kwargs.get(self.toggle) is not False))


_THINK = ("<think>", "</think>")
# SGLang 0.5.23's parser names (srt/parser/reasoning_parser.py) for these formats.
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(*_THINK, always=True),
    "step3": ReasoningFormat(*_THINK, always=True),
    "qwen3": ReasoningFormat(*_THINK, toggle="enable_thinking", tool_start="<tool_call>"),
    "qwen3-thinking": ReasoningFormat(*_THINK, always=True, tool_start="<tool_call>"),
    "glm45": ReasoningFormat(*_THINK, toggle="enable_thinking", tool_start="<tool_call>"),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """ValueError naming the known parsers for an unknown name."""
    if (fmt := REASONING_PARSERS.get(name.lower())) is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return fmt


class ReasoningParser:
    """One choice's reply. `feed` returns the (reasoning, content) that are certain so far;
    with stream_reasoning false (SGLang's field) the reasoning comes in one piece when its
    block ends, instead of delta by delta."""

    def __init__(self, fmt: ReasoningFormat, inside: bool, stream_reasoning: bool = True) -> None:
        self.fmt = fmt
        self.inside = inside
        self.stream_reasoning = stream_reasoning
        self._state = "inside" if inside else "before"  # -> "inside" -> "after"
        self._settled = False  # whether the reply opens with the start marker is known
        self._buf = ""  # held back: a possible marker, or the block so far (not streamed)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        """The end of the reply: what was held back is settled (a cut-off block is reasoning)."""
        return self._step(final=True)

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole reply (this parser's own state is not touched): the reasoning (None when
        there is none) and the content."""
        fresh = ReasoningParser(self.fmt, self.inside)
        r1, c1 = fresh.feed(text)
        r2, c2 = fresh.finish()
        return (r1 + r2) or None, c1 + c2

    def _step(self, final: bool) -> tuple[str, str]:
        start = self.fmt.start
        if not self._settled and self._state != "after":
            head = self._buf.lstrip()
            if head.startswith(start):  # a model made to think may still write the marker
                self._state, self._buf = "inside", head[len(start):]
            elif not final and start.startswith(head):
                return "", ""  # may still become the start marker
            elif self._state == "before":
                self._state = "after"
            self._settled = True
        if self._state == "after":
            content, self._buf = self._buf, ""
            return "", content
        cut, resume = self._block_end()
        if cut >= 0:
            reasoning, content = self._buf[:cut], self._buf[resume:]
            self._state, self._buf = "after", ""
            return reasoning, content
        if final:
            reasoning, self._buf = self._buf, ""
            return reasoning, ""
        if not self.stream_reasoning:
            return "", ""
        keep = max(partial_suffix(self._buf, m) for m in (self.fmt.end, self.fmt.tool_start) if m)
        reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return reasoning, ""

    def _block_end(self) -> tuple[int, int]:
        """Where the block's text ends and the content starts; (-1, -1) when not yet seen.
        A tool call's opening ends the block too, and stays in the content for its parser."""
        found = [(i, i + len(self.fmt.end)) for i in [self._buf.find(self.fmt.end)] if i >= 0]
        if self.fmt.tool_start:
            found += [(i, i) for i in [self._buf.find(self.fmt.tool_start)] if i >= 0]
        return min(found) if found else (-1, -1)

"""The shape every tool-call parser shares: a state machine over the generated text. `feed` returns
what is certain so far: content that can no longer start a call, and call deltas in OpenAI's
order (id and name, then `arguments` in pieces); possible markup is held back. `parse` runs the
same machine over a whole text, so a stream cut anywhere concatenates to what `parse` returns.

Markup that turns out not to be a call before one was announced is released as content. An
announced call cannot be taken back; if its markup then breaks, `parse` returns everything as
content: a non-streaming client should get the model's text rather than a broken call."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

from lockstep.function_call.json_call import JsonCallScanner, Status


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of an object, as the model wrote it


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set, with name, on a call's first delta only
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(frozen=True)
class ParseResult:
    content: str | None  # None when there are calls and no text around them
    calls: list[ToolCall]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if text.endswith(marker[:k])), 0)


class ToolCallParser(ABC):
    """Base of the parsers: content bookkeeping (whitespace next to a call is dropped) and call
    bookkeeping. Subclasses implement `_step`, which advances `_pos` through `_buf`."""

    name: str = ""

    def __init__(self, tool_names: Iterable[str]) -> None:
        self.tool_names = frozenset(tool_names)
        self._buf = ""
        self._pos = 0
        self._finished = False
        self._out = StreamDelta()
        self._pending_ws = ""  # trailing whitespace: dropped if a call follows, else released
        self._after_call = False  # whitespace right after a call is dropped too
        self._calls: list[list[str]] = []  # [id, name, arguments...]
        self._open_call = False
        self._malformed = False
        self._scanner: JsonCallScanner | None = None  # the JSON call being read
        self._mode = "start"  # the subclass's state: "content", "block", "discard", ...
        self._block_start = self._marker_len = 0  # where that call's marker began, its length

    def feed(self, text: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> StreamDelta:
        """The end of the text: whatever was held back is settled."""
        if not self._finished:
            while self._step(final=True):
                pass
            if self._open_call:  # cut off inside a call (length limit): not a usable call
                self._malformed = True
                self._open_call = False
            self._out.content += self._pending_ws
            self._pending_ws = ""
            self._finished = True
        return self._take()

    def parse(self, text: str) -> ParseResult:
        """The whole text at once (this parser's own stream state is not touched)."""
        fresh = type(self)(self.tool_names)
        content = fresh.feed(text).content + fresh.finish().content
        if fresh._malformed:
            return ParseResult(content=text, calls=[])
        calls = [ToolCall(id=c[0], name=c[1], arguments="".join(c[2:])) for c in fresh._calls]
        return ParseResult(content=content or (None if calls else ""), calls=calls)

    @property
    def malformed(self) -> bool:
        """A call announced to the stream whose markup then broke (or was cut off)."""
        return self._malformed

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Consume what can be consumed from `_buf[_pos:]`; False when more text is needed
        (with `final`, it must eventually consume everything)."""

    def _content(self, text: str) -> None:
        """Plain text from the model; whitespace at its end waits to see what follows."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        self._out.content += body

    def _start_call(self, name: str) -> None:
        self._pending_ws = ""
        self._after_call = False
        self._calls.append([f"call_{uuid.uuid4().hex[:24]}", name])
        self._open_call = True
        self._out.calls.append(ToolCallDelta(len(self._calls) - 1, self._calls[-1][0], name))

    def _arguments(self, piece: str) -> None:
        if not piece:
            return
        self._calls[-1].append(piece)
        index = len(self._calls) - 1
        last = self._out.calls[-1] if self._out.calls else None
        if last is not None and last.index == index:
            last.arguments += piece
        else:
            self._out.calls.append(ToolCallDelta(index, arguments=piece))

    def _end_call(self, ok: bool) -> None:
        self._open_call = False
        self._after_call = True
        self._malformed = self._malformed or not ok

    def _open_json_call(self, at: int, marker_len: int = 0) -> None:
        """Start reading a {"name": ..., "arguments": ...} object after a marker (a tag, or
        nothing) of `marker_len` characters at `at`; the mode becomes "block"."""
        self._mode = "block"
        self._block_start, self._marker_len = at, marker_len
        self._pos = at + marker_len
        self._scanner = JsonCallScanner(self.tool_names, self._pos, self._start_call,
                                        self._arguments)

    def _advance_json_call(self, final: bool) -> Status:
        """Feed the call being read. DONE: the call ended and `_pos` is past it; FAILED: not a
        call of this shape (ended as malformed if its name was already announced); MORE: more
        text is needed."""
        scanner = self._scanner
        if scanner is None:
            return Status.MORE
        status = scanner.advance(self._buf, final)
        if status is Status.DONE:
            self._pos = scanner.end
            self._end_call(ok=True)
        elif status is Status.FAILED and scanner.announced:
            self._end_call(ok=False)
        return status

    def _content_until(self, marker: str, final: bool) -> bool:
        """Content up to `marker`, where a JSON call opens (mode "block"); text that may be the
        marker's start is held back. False when more text is needed."""
        rest = self._buf[self._pos:]
        i = rest.find(marker)
        if i < 0:
            n = len(rest) - (0 if final else partial_suffix(rest, marker))
            self._content(rest[:n])
            self._pos += n
            return False
        self._content(rest[:i])
        self._open_json_call(self._pos + i, len(marker))
        return True

    def _json_block(self, final: bool, done_mode: str) -> bool:
        """Advance a call opened after a marker, for parsers that read content around calls:
        once it ends, `_mode` becomes `done_mode`; broken after it was announced, "discard"
        from where it broke; not a call at all, its marker (or first character) is content and
        scanning resumes after it."""
        status = self._advance_json_call(final)
        if status is Status.MORE:
            return False
        if status is Status.DONE:
            self._mode = done_mode
        elif self._scanner is not None and self._scanner.announced:
            self._pos = self._scanner.i
            self._mode = "discard"
        else:
            n = max(1, self._marker_len)
            self._content(self._buf[self._block_start:self._block_start + n])
            self._pos = self._block_start + n
            self._mode = "content"
        return True

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

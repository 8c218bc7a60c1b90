"""Incremental detokenization of one request's output, with stop strings.

Decoding token by token is wrong for byte-level and SentencePiece vocabularies: a character can
span several tokens, and a token's leading space depends on what precedes it. So, as SGLang and
vLLM do, each step decodes a short window that starts a few tokens back (the "surrogate" prefix)
and emits the difference between the window with and without the new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import regex

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class DetokOutput:
    text_delta: str
    matched_stop: str | None
    finished: bool


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas for one request.

    Text is emitted only once it is final: never half a multi-byte character, and never a suffix
    that could still grow into a stop string or a stop regex match (that suffix is held back
    until it cannot: the `regex` module's partial matching says so for a regex).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        stop_regex: Sequence[str] = (),
    ) -> None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not s for s in stops):
            # An empty stop string would match before the first token.
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._stops = tuple(dict.fromkeys(stops))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._no_stop_trim = no_stop_trim
        self._stop_regex = tuple((p, regex.compile(p)) for p in dict.fromkeys(stop_regex))

        self._ids: list[int] = []
        # ids[surr:read] is already-decoded context for the window; ids[read:] is not yet emitted.
        self._surr = 0
        self._read = 0
        self._stable = ""  # text of every committed output token
        self._pending = ""  # text of uncommitted tokens, minus a trailing incomplete character
        self._text = ""  # what the caller has been given
        self._matched_stop: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        return self._text

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    def push(self, new_ids: Sequence[int]) -> DetokOutput:
        if self._finished:
            return DetokOutput("", self._matched_stop, True)
        self._ids.extend(int(t) for t in new_ids)
        prefix_text = self._decode(self._ids[self._surr : self._read])
        window_text = self._decode(self._ids[self._surr :])
        new_text = window_text[len(prefix_text) :]
        if new_text and not new_text.endswith(_REPLACEMENT_CHAR):
            self._stable += new_text
            self._pending = ""
            self._surr, self._read = self._read, len(self._ids)
        else:
            # A trailing U+FFFD is (usually) a character whose remaining bytes are still to come;
            # the text in front of it is final and may already go out.
            self._pending = new_text.rstrip(_REPLACEMENT_CHAR)
        return self._advance(final=False)

    def flush(self) -> str:
        """Releases held-back text when the request ends (not an incomplete trailing char)."""
        if self._finished:
            return ""
        out = self._advance(final=True)
        self._finished = True
        return out.text_delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, **self._decode_kwargs)

    def _advance(self, *, final: bool) -> DetokOutput:
        visible = self._stable + self._pending
        start = len(self._text)
        hit = self._find_stop(visible, start)
        if hit is not None:
            pos, stop_end, stop = hit
            end = stop_end if self._no_stop_trim else pos
            delta = visible[start:end]
            self._text += delta
            self._finished = True
            self._matched_stop = stop
            return DetokOutput(delta, stop, True)
        end = len(visible) if final else len(visible) - self._held_back(visible, start)
        delta = visible[start:end]
        self._text += delta
        return DetokOutput(delta, None, False)

    def _find_stop(self, visible: str, start: int) -> tuple[int, int, str] | None:
        """(start, end, what matched) of the earliest stop in the unreleased text.

        Only unreleased text can hold a match: held-back text guarantees that no stop string
        straddles what was already released. What a regex matched is reported as its pattern."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            pos = visible.find(stop, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, pos + len(stop), stop)
        for pattern, compiled in self._stop_regex:
            m = compiled.search(visible, start)
            if m is not None and (best is None or m.start() < best[0]):
                best = (m.start(), m.end(), pattern)
        return best

    def _held_back(self, visible: str, start: int) -> int:
        """Length of the longest unreleased suffix that could still become a stop."""
        held = 0
        for _, compiled in self._stop_regex:
            m = compiled.search(visible, start, partial=True)
            if m is not None and m.partial:
                held = max(held, len(visible) - m.start())
        for k in range(min(self._max_stop_len - 1, len(visible) - start), held, -1):
            suffix = visible[len(visible) - k :]
            if any(stop.startswith(suffix) for stop in self._stops):
                return k
        return held

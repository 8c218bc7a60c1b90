"""Incremental detokenization of one request's output.

Decoding token by token is wrong for byte-level and SentencePiece vocabularies: a character can
span several tokens, and a token's leading space depends on what precedes it. So, as SGLang and
vLLM do, each step decodes a short window that starts a few tokens back (the "surrogate" prefix)
and takes the difference between the window with and without the new tokens.

The same class runs in two processes on the same tokens: the detokenizer (text for the client)
and the scheduler's stop checker (managers/stop_checker.py), whose character offsets into `text`
(`ReqOutput.text_limit`) are therefore offsets into the detokenizer's text too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(args: Any) -> Any:
    """The HF tokenizer of `args` (ServerArgs) that every process decodes with: the front, the
    detokenizer and the schedulers."""
    from transformers import AutoTokenizer

    from lockstep.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(args.tokenizer_path or str(resolve_model(args.model_path).model_dir))


class IncrementalDetokenizer:
    """Turns a stream of token ids into text that only grows: never half a multi-byte character.

    `text` is every character that is final so far; `release(limit)` hands out what the caller
    has not had yet, up to `limit` characters (a stop the scheduler matched, or a suffix that
    could still become one, is held back that way)."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._decode_kwargs = {"skip_special_tokens": skip_special_tokens,
                               "spaces_between_special_tokens": spaces_between_special_tokens}
        self._ids: list[int] = []
        # ids[surr:read] is already-decoded context for the window; ids[read:] is not yet stable.
        self._surr = 0
        self._read = 0
        self._stable = ""  # text of every committed token
        self._pending = ""  # text of uncommitted tokens, minus a trailing incomplete character
        self.released = 0  # characters of `text` handed out by `release`

    @property
    def text(self) -> str:
        return self._stable + self._pending

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; returns `text`."""
        self._ids.extend(int(t) for t in new_ids)
        prefix_text = self._decode(self._ids[self._surr : self._read])
        new_text = self._decode(self._ids[self._surr :])[len(prefix_text) :]
        if new_text and not new_text.endswith(_REPLACEMENT_CHAR):
            self._stable += new_text
            self._pending = ""
            self._surr, self._read = self._read, len(self._ids)
        else:
            # A trailing U+FFFD is (usually) a character whose remaining bytes are still to come;
            # the text in front of it is final and may already go out.
            self._pending = new_text.rstrip(_REPLACEMENT_CHAR)
        return self.text

    def release(self, limit: int | None = None) -> str:
        """The text not released yet, up to `limit` characters of `text` (None: all of it)."""
        text = self.text
        end = len(text) if limit is None else min(limit, len(text))
        delta = text[self.released : end]
        self.released = max(self.released, end)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, **self._decode_kwargs)

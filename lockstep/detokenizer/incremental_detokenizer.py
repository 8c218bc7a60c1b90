"""Incremental detokenization of one request's output. Token by token is wrong for byte-level and
SentencePiece vocabularies (a character can span tokens; a leading space depends on what
precedes), so, as SGLang and vLLM do, each step decodes a window starting a few tokens back and
keeps the difference. The detokenizer and the scheduler's stop checker run it on the same tokens,
so the stop checker's offsets (`ReqOutput.text_limit`) are offsets into the client's text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(args: Any) -> Any:
    """The HF tokenizer of `args` (ServerArgs) that every process decodes with."""
    from transformers import AutoTokenizer

    from lockstep.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(args.tokenizer_path or str(resolve_model(args.model_path).model_dir))


class IncrementalDetokenizer:
    """Token ids in, text that only grows out (never half a character): `text` is what is final;
    `release(limit)` hands out what the caller has not had, up to `limit` characters."""

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
        return self._tokenizer.decode(ids, **self._decode_kwargs) if ids else ""

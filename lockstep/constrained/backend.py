"""Per-request grammar matchers over the model's vocabulary, one backend per scheduler rank: every
rank builds the same matchers and feeds them the same tokens, so the masks agree unexchanged. A
mask is int32 [rows, ceil(V / 32)], bit i of word w = token 32w + i allowed (llguidance's layout);
ids past the tokenizer (a padded LM head) are never allowed."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
import torch

from lockstep.constrained.constraint import (
    GRAMMAR_LIMITS,
    Constraint,
    ConstraintError,
    clean_grammar_error,
)

# Why a constrained request is a 400 on a model whose tokenizer llguidance cannot read.
NO_GRAMMAR_BACKEND = "this model has no tokenizer.json: regex, json_schema and ebnf are not available"
# Compiled grammars kept per rank, by constraint text; the oldest unused one goes first.
GRAMMAR_CACHE_SIZE = 256


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and when it is done."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it or fails on it
        (a limit hit while generating: going on would drop the constraint)."""
        return self._m.consume_token(token) and not self._m.is_error()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept from here (nothing consumed):
        a speculative draft is cut before the first token the grammar forbids."""
        return self._m.validate_tokens(list(tokens)) if tokens else 0

    @property
    def is_terminated(self) -> bool:
        """Nothing more may follow (the grammar is complete, or an end token was accepted)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return clean_grammar_error(self._m.get_error())


def grammar_vocabulary(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary (seconds to build on a 262k vocabulary)."""
    size = hf_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=max(size, vocab_size),
                                        eos_token=sorted(eos_token_ids) or None)


class GrammarBackend:
    """Compiles constraints against the rank's fast HF tokenizer (the stop strings' one), caches
    them, hands out matchers. The llguidance vocabulary is built here, at start-up (seconds on a
    262k vocabulary, holding the GIL): `vocabulary` builds it (grammar_vocabulary of the same
    tokenizer by default; a process with many schedulers of one model passes one it built once).
    `compile` runs on a thread of its own, so the scheduler's loop never waits for a grammar."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 num_threads: int = 1,
                 vocabulary: Callable[[], llguidance.LLTokenizer] | None = None) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.model_vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.num_threads = max(1, num_threads)
        build = vocabulary or (lambda: grammar_vocabulary(hf_tokenizer, vocab_size, self.eos_token_ids))
        self.tokenizer: llguidance.LLTokenizer = build()
        self._executor: llguidance.LLExecutor | None = None
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()  # the compile thread and direct callers share it
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="lockstep-grammar")

    def compile(self, constraint: Constraint) -> Future[GrammarMatcher]:
        """`matcher(constraint)` on the compile thread, in submission order: the future's result
        is the matcher, or ConstraintError when the constraint does not compile."""
        return self._compiler.submit(self.matcher, constraint)

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for `constraint`; ConstraintError when it does not compile."""
        with self._cache_lock:
            proto = self._cache.get(constraint)
            if proto is not None:
                self._cache.move_to_end(constraint)
        if proto is None:
            proto = llguidance.LLMatcher(self.tokenizer, constraint.grammar(), log_level=0,
                                         limits=GRAMMAR_LIMITS)
            if proto.is_error():
                raise ConstraintError(f"invalid {constraint.kind}: "
                                      f"{clean_grammar_error(proto.get_error())}")
            with self._cache_lock:
                self._cache[constraint] = proto
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GrammarMatcher(proto.deep_copy())

    def fill_masks(self, matchers: Sequence[GrammarMatcher],
                   drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The next-token bitmask of each matcher, computed in parallel: one row each, followed,
        for a matcher with a speculative draft, by one row per draft token (its mask after
        the draft up to that token; the grammar must accept the draft: Speculator cuts it)."""
        drafts = drafts or [()] * len(matchers)
        words = (self.tokenizer.vocab_size + 31) // 32
        rows = sum(1 + len(d) for d in drafts)
        mask = torch.full((rows, words), -1, dtype=torch.int32)
        row_bytes = words * mask.element_size()
        if len(matchers) == 1 and not drafts[0]:
            matchers[0]._m.unsafe_compute_mask_ptr(mask.data_ptr(), row_bytes)
        elif matchers:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
            starts = [0]
            for d in drafts[:-1]:
                starts.append(starts[-1] + 1 + len(d))
            plain = [(m._m, i) for m, i, d in zip(matchers, starts, drafts) if not d]
            # A copy steps through each draft: llguidance rolls a matcher back after its draft, but
            # not when a grammar limit is hit part-way, which would leave the request's own matcher
            # advanced past tokens it never accepted.
            drafting = [(m._m.deep_copy(), i, list(d)) for m, i, d in zip(matchers, starts, drafts) if d]
            if plain:
                self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), row_bytes, rows)
            if drafting:
                self._executor.unsafe_compute_mask_ptr_with_draft_token(
                    drafting, mask.data_ptr(), row_bytes, rows)
        return mask


def grammar_backend_for(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                        vocabulary: Callable[[], llguidance.LLTokenizer] | None = None) -> GrammarBackend | None:
    """The backend of a scheduler rank, its vocabulary built; None when the tokenizer is not a
    fast (tokenizer.json) one: llguidance reads the Rust tokenizer."""
    if not getattr(hf_tokenizer, "is_fast", False):
        return None
    return GrammarBackend(hf_tokenizer, vocab_size, eos_token_ids,
                          num_threads=torch.get_num_threads(), vocabulary=vocabulary)


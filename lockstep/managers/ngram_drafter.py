"""N-gram drafts for speculative decoding (SGLang's NGRAM algorithm in spirit): the tokens that
followed the latest earlier occurrence of the request's last n tokens (n from the max window
down), in its own prompt and output or in a bounded store of recent requests' tokens. A pure
function of the tokens in the order the scheduler feeds them (no clock, set order or randomness),
so every rank drafts alike without sending drafts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramConfig:
    # SGLang's flags (their defaults and reasons: server_args.py)
    max_draft: int  # --speculative-num-draft-tokens: the most tokens one verify pass checks
    min_window: int  # --speculative-ngram-min-match-window-size
    max_window: int  # --speculative-ngram-max-match-window-size
    capacity: int  # --speculative-ngram-capacity: n-grams kept across requests


class TokenIndex:
    """Where each n-gram (min_window <= n <= max_window) of one token list last ended and where it
    ended the time before, updated one token at a time (a dict update per window size)."""

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (last end, previous end)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.cfg.min_window, min(self.cfg.max_window, end) + 1):
                key = tuple(self.tokens[end - n:end])
                last = self._ends.get(key)
                self._ends[key] = (end, last[0] if last else -1)

    def continuation(self, k: int) -> list[int]:
        """k tokens that followed the longest suffix's latest earlier occurrence. Where they run
        into the end, the copy goes on from its own start (an LZ77 overlapping copy): text in a
        loop of p tokens drafts the loop on, not just the p tokens up to the end (greedy decoding
        that loops drafted one token a pass and gained little)."""
        end = len(self.tokens)
        for n in range(min(self.cfg.max_window, end - 1), self.cfg.min_window - 1, -1):
            hit = self._ends.get(tuple(self.tokens[end - n:end]))
            if hit is not None and hit[1] > 0:
                draft: list[int] = []
                for j in range(hit[1], hit[1] + k):
                    draft.append(self.tokens[j] if j < end else draft[j - end])
                return draft
        return []


class NgramStore:
    """Continuations of recent requests' n-grams, bounded to `capacity` entries (least recently
    written dropped first), so a prompt that repeats another request's text drafts from it too."""

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self._next: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: Sequence[int]) -> None:
        toks, k = list(tokens), self.cfg.max_draft
        for end in range(self.cfg.min_window, len(toks)):
            follow = tuple(toks[end:end + k])
            for n in range(self.cfg.min_window, min(self.cfg.max_window, end) + 1):
                key = tuple(toks[end - n:end])
                self._next[key] = follow
                self._next.move_to_end(key)
        while len(self._next) > self.cfg.capacity:
            self._next.popitem(last=False)

    def continuation(self, tokens: Sequence[int], k: int) -> list[int]:
        end = len(tokens)
        for n in range(min(self.cfg.max_window, end), self.cfg.min_window - 1, -1):
            follow = self._next.get(tuple(tokens[end - n:end]))
            if follow:
                return list(follow[:k])
        return []


@dataclass
class DraftState:
    """One request's drafting: its token index and how long its next draft may be. The length
    follows acceptance: a draft taken whole doubles it (up to the max), a partly taken one sets it
    to what was taken plus one; a request whose drafts keep failing stops drafting for a while,
    twice as long each time, so text without repetition costs almost nothing."""

    index: TokenIndex
    length: int
    pause: int = 0  # decode steps left without drafting
    backoff: int = 1
    # decode steps since it drafts, each a verify pass of 0 or more draft tokens (SGLang's
    # spec_verify_ct: there every decode step of a speculating server verifies)
    verify_ct: int = 0
    drafted: int = 0  # draft tokens over them
    accepted: int = 0  # ... and how many were accepted
    misses: int = 0  # verify passes in a row that accepted nothing
    last_whole: bool = True  # the last verified draft was accepted whole (True before any)


class NgramDrafter:
    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self.store = NgramStore(cfg)

    def new_state(self) -> DraftState:
        return DraftState(TokenIndex(self.cfg), self.cfg.max_draft)

    def propose(self, state: DraftState, tokens: Sequence[int], room: int) -> list[int]:
        """The draft for the request's next step, given all its tokens so far (prompt and output;
        the index takes in what it has not seen), at most `room` tokens (what max_new_tokens and
        the context still allow after the token this step samples anyway)."""
        state.index.extend(tokens[len(state.index.tokens):])
        if state.pause > 0:
            state.pause -= 1
            return []
        k = min(state.length, room)
        if k <= 0:
            return []
        return state.index.continuation(k) or self.store.continuation(state.index.tokens, k)

    def observe(self, state: DraftState, drafted: int, accepted: int) -> None:
        """How much of a verified draft was accepted (a decode step without a draft: 0 of 0)."""
        state.verify_ct += 1
        if not drafted:
            return
        state.drafted += drafted
        state.accepted += accepted
        state.last_whole = accepted == drafted
        if accepted == drafted:
            state.length = min(self.cfg.max_draft, 2 * state.length)
            state.misses, state.backoff = 0, 1
        elif accepted:
            state.length = accepted + 1
            state.misses = 0
        else:
            state.length = max(1, state.length // 2)
            state.misses += 1
            if state.misses >= 2:  # two misses in a row: pause, longer each time
                state.pause, state.backoff = state.backoff, min(64, 2 * state.backoff)
                state.misses = 0

    def finished(self, tokens: Sequence[int]) -> None:
        """A request ended: its tokens join the cross-request store (in finish order, every rank alike)."""
        self.store.add(tokens)

"""The n-gram drafter alone: what it matches, its bounded store, and that two drafters fed the same
inputs draft the same tokens (the ranks' lockstep depends on it)."""

from __future__ import annotations

import random

from lockstep.managers.ngram_drafter import NgramConfig, NgramDrafter, NgramStore, TokenIndex

CFG = NgramConfig(max_draft=4, min_window=2, max_window=4, capacity=1000)


def test_the_longest_suffix_drafts_what_followed_its_latest_earlier_occurrence() -> None:
    index = TokenIndex(CFG)
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # [1, 2, 3] occurred at 0..3 (then 4, 5, ...); [2, 3] last occurred before at 6..8 (then 7, 8)
    assert index.continuation(4) == [4, 5, 9, 2]
    index.extend([6])  # [.., 3, 6] never occurred before, nor [6] alone (and 1-grams are not matched)
    assert index.continuation(4) == []


def test_a_short_suffix_matches_when_a_long_one_does_not() -> None:
    index = TokenIndex(CFG)
    index.extend([5, 6, 7, 8, 0, 6, 7])
    assert index.continuation(3) == [8, 0, 6]  # [6, 7] matched; [0, 6, 7] and longer did not


def test_no_draft_from_the_suffix_itself_and_a_loop_drafts_on() -> None:
    index = TokenIndex(CFG)
    index.extend([1, 2])
    assert index.continuation(4) == []  # the only [1, 2] is the suffix
    index.extend([1, 2])
    # what followed the first [1, 2] runs into the end: the copy goes on from its own start
    assert index.continuation(4) == [1, 2, 1, 2]
    index.extend([7, 8, 9, 1, 2])
    assert index.continuation(7) == [7, 8, 9, 1, 2, 7, 8]  # a loop of 5 from its last [1, 2]


def test_the_store_drafts_across_requests_and_stays_bounded() -> None:
    store = NgramStore(NgramConfig(max_draft=3, min_window=2, max_window=3, capacity=50))
    store.add([10, 11, 12, 13, 14, 15])
    assert store.continuation([99, 11, 12], 3) == [13, 14, 15]
    rng = random.Random(0)
    for _ in range(20):
        store.add([rng.randrange(1000) for _ in range(30)])
    assert len(store) == 50  # least recently written entries went first
    assert store.continuation([99, 11, 12], 3) == []


def test_drafts_follow_acceptance_and_pause_after_misses() -> None:
    drafter, tokens = NgramDrafter(CFG), [1, 2, 3, 4, 1, 2]
    state = drafter.new_state()
    assert drafter.propose(state, tokens, room=10) == [3, 4, 1, 2]
    drafter.observe(state, drafted=4, accepted=1)
    tokens += [3, 4]
    assert state.length == 2 and state.verify_ct == 1 and state.accepted == 1
    assert drafter.propose(state, tokens, room=10) == [1, 2]  # [3, 4] matched, at most 2 now
    assert drafter.propose(state, tokens, room=0) == []  # no room: never past max_new_tokens
    for _ in range(2):
        drafter.observe(state, drafted=2, accepted=0)
    tokens += [9]
    assert state.pause == 1 and drafter.propose(state, tokens, room=10) == []  # paused a step


def _drafts_of_a_run(seed: int) -> list[list[int]]:
    """One drafter fed requests (prompts, then steps emitting the draft's first token or another)."""
    rng, drafter, out = random.Random(seed), NgramDrafter(CFG), []
    for _ in range(12):
        state, tokens = drafter.new_state(), [rng.randrange(20) for _ in range(rng.randrange(5, 60))]
        for _ in range(10):
            draft = drafter.propose(state, tokens, room=8)
            out.append(draft)
            tokens += draft[:2] if draft else [rng.randrange(20)]
            if draft:
                drafter.observe(state, drafted=len(draft), accepted=min(1, len(draft) - 1))
        drafter.finished(tokens)
    return out


def test_two_drafters_fed_the_same_inputs_draft_the_same() -> None:
    first = _drafts_of_a_run(3)
    assert first == _drafts_of_a_run(3) and sum(map(bool, first)) > 20

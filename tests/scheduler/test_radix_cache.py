"""RadixCache: unit tests plus a state machine checked against a naive model.

The model stores every cached *prefix* (a prefix-closed set of token tuples),
each with the slot of its last token, a last-access time and a lock count.
Matching is then "longest stored prefix", and LRU eviction is done one token at
a time. Because all tokens of a tree node share their access history, evicting
the tree's reported number of tokens token-by-token must leave exactly what the
tree left.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from lockstep.mem_cache.radix_cache import ChunkCache, RadixCache, TreeNode


class CheckedAllocator:
    """A real free-list allocator that fails loudly on double or foreign frees."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.device = torch.device("cpu")
        self._free = torch.arange(size, dtype=torch.int64)
        self._in_use = torch.zeros(size, dtype=torch.bool)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        self._in_use[out] = True
        return out

    def free(self, indices: torch.Tensor) -> None:
        assert indices.dtype == torch.int64
        assert indices.unique().numel() == indices.numel(), "duplicate slots in one free()"
        assert bool(self._in_use[indices].all()), f"double free of {indices.tolist()}"
        self._in_use[indices] = False
        self._free = torch.cat([self._free, indices])

    def available_size(self) -> int:
        return self._free.numel()


def alloc(allocator: CheckedAllocator, n: int) -> torch.Tensor:
    out = allocator.alloc(n)
    assert out is not None
    return out


def insert(cache: RadixCache, allocator: CheckedAllocator, key: list[int]) -> torch.Tensor:
    """Insert ``key`` the way the scheduler does: fresh slots, free the duplicates."""
    value = alloc(allocator, len(key))
    n = cache.insert(key, value)
    if n:
        allocator.free(value[:n])
    return value


# --------------------------------------------------------------------------- unit tests


def test_match_splits_node_mid_run() -> None:
    pool = CheckedAllocator(16)
    cache = RadixCache(pool)
    value = insert(cache, pool, [1, 2, 3, 4])

    indices, node = cache.match_prefix([1, 2, 9])

    assert indices.tolist() == value[:2].tolist()
    assert node.key == (1, 2)
    assert list(node.children) == [3]
    assert node.children[3].key == (3, 4)
    assert node.children[3].value.tolist() == value[2:].tolist()
    assert node.parent is cache.root
    assert cache.total_size() == 4
    # The full sequence still matches across the split.
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == value.tolist()


def test_match_on_empty_tree_returns_root() -> None:
    cache = RadixCache(CheckedAllocator(4))
    indices, node = cache.match_prefix([7, 8])
    assert indices.numel() == 0 and indices.dtype == torch.int64
    assert node is cache.root


def test_insert_returns_already_present_length() -> None:
    pool = CheckedAllocator(32)
    cache = RadixCache(pool)
    first = insert(cache, pool, [1, 2, 3])

    value = alloc(pool, 5)
    assert cache.insert([1, 2, 3, 4, 5], value) == 3
    pool.free(value[:3])
    # The tree kept its original slots for the shared part.
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == first.tolist() + value[3:].tolist()

    value = alloc(pool, 3)
    assert cache.insert([1, 2, 7], value) == 2  # diverges mid-node
    pool.free(value[:2])
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
    assert cache.total_size() == 6
    assert pool.available_size() + cache.total_size() == 32


def test_insert_rejects_mismatched_value() -> None:
    cache = RadixCache(CheckedAllocator(8))
    with pytest.raises(ValueError):
        cache.insert([1, 2], torch.tensor([0], dtype=torch.int64))
    with pytest.raises(ValueError):
        cache.insert([1], torch.tensor([0], dtype=torch.int32))


def test_lru_evicts_oldest_first() -> None:
    pool = CheckedAllocator(32)
    cache = RadixCache(pool)
    insert(cache, pool, [1, 1, 1])
    insert(cache, pool, [2, 2, 2])
    insert(cache, pool, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # refresh: [2,2,2] is now the oldest

    assert cache.evict(1) == 3  # whole nodes go
    assert cache.match_prefix([2, 2, 2])[0].numel() == 0
    assert cache.match_prefix([1, 1, 1])[0].numel() == 3
    assert cache.match_prefix([3, 3, 3])[0].numel() == 3
    # [1,1,1] was touched before [3,3,3] by the two matches above.
    assert cache.evict(3) == 3
    assert cache.match_prefix([1, 1, 1])[0].numel() == 0
    assert pool.available_size() + cache.total_size() == 32


def test_evict_climbs_to_parent_that_becomes_leaf() -> None:
    pool = CheckedAllocator(32)
    cache = RadixCache(pool)
    insert(cache, pool, [1, 2, 3])
    insert(cache, pool, [1, 2, 4])  # splits: [1,2] -> {[3], [4]}
    insert(cache, pool, [5])

    assert cache.evict(3) == 4  # [3], [4], then their parent [1,2]: all older than [5]
    assert cache.total_size() == 1
    assert cache.evict(100) == 1
    assert cache.total_size() == 0
    assert pool.available_size() == 32


def test_lock_protects_node_and_ancestors() -> None:
    pool = CheckedAllocator(32)
    cache = RadixCache(pool)
    insert(cache, pool, [1, 2, 3])
    insert(cache, pool, [1, 2, 4])
    _, node = cache.match_prefix([1, 2, 3])

    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3  # [3] and its ancestor [1,2]
    assert cache.evictable_size() == 1
    assert cache.evict(100) == 1  # only [4]
    assert cache.match_prefix([1, 2, 3])[0].numel() == 3

    # A split below a lock must not leak protection: the head inherits the lock
    # and the handle still unlocks everything.
    insert(cache, pool, [1, 2, 3, 5, 6])
    cache.match_prefix([1, 2, 3, 5])
    assert cache.protected_size() == 3
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    assert cache.evictable_size() == cache.total_size() == 5
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert cache.evict(100) == 5
    assert pool.available_size() == 32


def test_lock_on_root_is_a_no_op_and_survives_reset() -> None:
    cache = RadixCache(CheckedAllocator(4))
    _, root = cache.match_prefix([1])
    cache.inc_lock_ref(root)
    cache.reset()  # an empty match pins nothing, so it does not block a reset
    cache.dec_lock_ref(root)  # the handle is still the live root
    assert root is cache.root
    assert cache.protected_size() == 0


def test_reset_frees_everything_and_refuses_while_locked() -> None:
    pool = CheckedAllocator(32)
    cache = RadixCache(pool)
    insert(cache, pool, [1, 2, 3])
    insert(cache, pool, [1, 4])
    _, node = cache.match_prefix([1, 4])
    cache.inc_lock_ref(node)

    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.total_size() == 4

    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0
    assert cache.all_slot_indices().numel() == 0
    assert pool.available_size() == 32
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0


def test_eviction_order_is_deterministic() -> None:
    def run() -> list[list[int]]:
        pool = CheckedAllocator(64)
        cache = RadixCache(pool)
        for key in ([1, 2, 3], [1, 2, 4], [2, 2], [3], [1, 5], [2, 3, 3]):
            insert(cache, pool, key)
        cache.match_prefix([2, 2])
        cache.match_prefix([1, 2])
        order = []
        while cache.total_size():
            cache.evict(1)
            order.append(cache.all_slot_indices().tolist())
        return order

    assert run() == run()


def test_pretty_print_shows_structure() -> None:
    pool = CheckedAllocator(8)
    cache = RadixCache(pool)
    insert(cache, pool, [1, 2, 3])
    insert(cache, pool, [1, 2, 4])
    text = cache.pretty_print()
    assert "total=4" in text
    assert "[1, 2]" in text and "    [3]" in text and "    [4]" in text


def test_chunk_cache_holds_nothing() -> None:
    pool = CheckedAllocator(8)
    cache = ChunkCache(pool)
    value = alloc(pool, 3)
    assert cache.insert([1, 2, 3], value) == 3  # all "held": the caller frees its copies
    indices, node = cache.match_prefix([1, 2, 3])
    assert indices.numel() == 0 and indices.dtype == torch.int64
    assert isinstance(node, TreeNode)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert cache.evict(10) == 0
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.all_slot_indices().numel() == 0
    cache.reset()
    assert pool.available_size() == 5  # the caller still owns its slots
    assert isinstance(cache.pretty_print(), str)


# ------------------------------------------------------------------- state machine

POOL_SIZE = 48
keys = st.lists(st.integers(0, 2), max_size=8)


class Entry:
    __slots__ = ("slot", "last_access", "locks")

    def __init__(self, slot: int, last_access: int) -> None:
        self.slot = slot
        self.last_access = last_access
        self.locks = 0


class RadixCacheMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.pool = CheckedAllocator(POOL_SIZE)
        self.cache = RadixCache(self.pool)
        # Model: every cached prefix -> its last token's slot and bookkeeping.
        self.model: dict[tuple[int, ...], Entry] = {}
        self.clock = 0
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []

    # -- model helpers

    def model_match(self, key: list[int]) -> int:
        n = 0
        while n < len(key) and tuple(key[: n + 1]) in self.model:
            n += 1
        return n

    def model_evict(self, num_tokens: int) -> None:
        """Evict ``num_tokens`` tokens, oldest unlocked leaf token first."""
        for _ in range(num_tokens):
            leaves = [
                p
                for p, e in self.model.items()
                if e.locks == 0 and not any(p + (t,) in self.model for t in range(3))
            ]
            assert leaves, "tree evicted more than the model can"
            victim = min(leaves, key=lambda p: self.model[p].last_access)
            del self.model[victim]

    def evict_both(self, num_tokens: int) -> int:
        before = self.cache.evictable_size()
        evicted = self.cache.evict(num_tokens)
        assert evicted <= before
        assert evicted >= min(num_tokens, before)
        self.model_evict(evicted)
        return evicted

    def check_match(self, key: list[int]) -> TreeNode:
        self.clock += 1
        indices, node = self.cache.match_prefix(key)
        n = self.model_match(key)
        assert indices.dtype == torch.int64
        assert indices.tolist() == [self.model[tuple(key[: i + 1])].slot for i in range(n)]
        for i in range(n):
            self.model[tuple(key[: i + 1])].last_access = self.clock
        # The returned node ends exactly at the match.
        depth, walk = 0, node
        while walk is not self.cache.root:
            depth += len(walk.key)
            assert walk.parent is not None
            walk = walk.parent
        assert depth == n
        return node

    # -- rules

    @rule(key=keys)
    def insert(self, key: list[int]) -> None:
        value = self.pool.alloc(len(key))
        if value is None:
            self.evict_both(len(key) - self.pool.available_size())
            value = self.pool.alloc(len(key))
            if value is None:  # everything left is locked
                return
        self.clock += 1
        n = self.cache.insert(key, value)
        assert n == self.model_match(key)
        for i in range(len(key)):
            prefix = tuple(key[: i + 1])
            if prefix not in self.model:
                self.model[prefix] = Entry(int(value[i]), self.clock)
            self.model[prefix].last_access = self.clock
        if n:
            self.pool.free(value[:n])

    @rule(key=keys)
    def match(self, key: list[int]) -> None:
        self.check_match(key)

    @rule(key=keys)
    def match_and_lock(self, key: list[int]) -> None:
        node = self.check_match(key)
        n = self.model_match(key)
        self.cache.inc_lock_ref(node)
        for i in range(n):
            self.model[tuple(key[: i + 1])].locks += 1
        self.locks.append((node, tuple(key[:n])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, key = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)
        for i in range(len(key)):
            self.model[key[: i + 1]].locks -= 1

    @rule(num_tokens=st.integers(0, 20))
    def evict(self, num_tokens: int) -> None:
        self.evict_both(num_tokens)

    @rule()
    def reset(self) -> None:
        # A "lock" on the root (empty match) pins nothing, so it cannot block a reset.
        if any(key for _, key in self.locks):
            with pytest.raises(RuntimeError):
                self.cache.reset()
        else:
            self.cache.reset()
            self.model.clear()

    # -- invariants

    @invariant()
    def sizes_add_up(self) -> None:
        cache = self.cache
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        assert cache.total_size() == len(self.model)
        assert cache.protected_size() == sum(1 for e in self.model.values() if e.locks)
        assert self.pool.available_size() + cache.total_size() == POOL_SIZE

    @invariant()
    def slots_match_model(self) -> None:
        slots = self.cache.all_slot_indices().tolist()
        assert len(slots) == len(set(slots))
        assert sorted(slots) == sorted(e.slot for e in self.model.values())

    @invariant()
    def locked_tokens_still_cached(self) -> None:
        for node, key in self.locks:
            assert node is self.cache.root or node.lock_ref > 0
            assert all(key[: i + 1] in self.model for i in range(len(key)))


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
test_radix_cache_matches_model = RadixCacheMachine.TestCase

"""Prefix cache: a radix tree from token sequences to the KV slots that hold them. Requests that
share a prompt prefix reuse its KV slots; the tree owns them, and evicting a node frees them.

Determinism: peer schedulers replay the same calls and must evict the same nodes, so recency is a
logical clock bumped once per ``match_prefix`` / ``insert`` call, and ties fall back to a node
creation counter. Nothing here depends on wall time, ``id()`` or set ordering."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lockstep.mem_cache.memory_pool import TokenToKVPoolAllocator

__all__ = ["ChunkCache", "RadixCache", "TreeNode"]


@dataclass(eq=False, slots=True)  # eq=False: nodes compare and hash by identity
class TreeNode:
    """One edge of the radix tree: a run of tokens and the slots holding their KV. A node keeps
    the *tail* of its run when split, so a request's handle (its ``last_node``) stays valid and
    keeps covering the same tokens up to the root."""

    node_id: int
    key: tuple[int, ...]
    value: torch.Tensor
    parent: TreeNode | None
    lock_ref: int = 0
    last_access: int = 0
    # Keyed by the first token of the child's run: no two children start with the same token.
    children: dict[int, TreeNode] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.node_id}, key={list(self.key)}, lock_ref={self.lock_ref}, "
                f"last_access={self.last_access})")


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``, without slicing ``b``."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


def _as_key(key: Sequence[int]) -> tuple[int, ...]:
    # int() so a tensor or numpy key hashes by value, not by object identity.
    return tuple(int(t) for t in key)


class RadixCache:
    def __init__(self, allocator: TokenToKVPoolAllocator) -> None:
        self.allocator = allocator
        # Empty results live where slot indices do, or torch.cat(prefix, new_slots) fails.
        self.device = torch.device(allocator.device)
        self.root = TreeNode(0, (), self._empty(), None)
        self._reset_state()

    def _reset_state(self) -> None:
        # The root survives a reset: a request that matched nothing will still dec_lock_ref it.
        self.root.children.clear()
        self._node_ids = itertools.count(1)  # creation order: the tie-break of eviction
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match_prefix(self, key: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        node, _, values = self._walk(_as_key(key), self._tick())
        return (torch.cat(values) if values else self._empty()), node

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        tokens = _as_key(key)
        if value.dim() != 1 or value.numel() != len(tokens):
            raise ValueError(f"value has shape {tuple(value.shape)}, key has {len(tokens)} tokens")
        if value.dtype != torch.int64:
            raise ValueError(f"value must be int64 slot indices, got {value.dtype}")
        now = self._tick()
        node, i, _ = self._walk(tokens, now)
        if i < len(tokens):
            # clone(): the tree never aliases (and keeps alive) the caller's larger tensor.
            leaf = TreeNode(next(self._node_ids), tokens[i:], value[i:].clone(), node,
                            last_access=now)
            node.children[tokens[i]] = leaf
            self._evictable += len(leaf.key)
        # The already-cached part keeps the tree's slots; the caller must free its duplicates.
        return i

    def _walk(self, tokens: tuple[int, ...], now: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow ``tokens`` down from the root, stamping each node passed with ``now``: the
        deepest node reached, how many tokens it covers, and the slot runs on the way."""
        node = self.root
        values: list[torch.Tensor] = []
        i = 0
        while i < len(tokens):
            if (child := node.children.get(tokens[i])) is None:
                break
            n = _common_prefix_len(child.key, tokens, i)
            if n < len(child.key):
                # Split so the node ends at the match: its locker must not pin tokens it lacks.
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node = child
            i += n
        return node, i, values

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child`` after ``at`` tokens; return the new head node. ``child`` keeps the tail so
        handles to it stay valid; the head inherits ``lock_ref``, as every lock on ``child`` also
        covers its ancestors, which now include the head."""
        assert 0 < at < len(child.key)
        parent = child.parent
        assert parent is not None
        head = TreeNode(next(self._node_ids), child.key[:at], child.value[:at].clone(), parent,
                        lock_ref=child.lock_ref, last_access=child.last_access)
        parent.children[head.key[0]] = head
        child.key = child.key[at:]
        child.value = child.value[at:].clone()
        child.parent = head
        head.children[child.key[0]] = child
        return head

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                # Catches a double unlock, or a handle from before a reset().
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        # (last_access, node_id) is unique: the heap never compares nodes, and the order is a
        # pure function of the call history.
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.value)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            evicted += len(node.key)
            self._evictable -= len(node.key)
            # Removing the last child makes the parent a leaf, maybe the oldest one left.
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return evicted

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and node.lock_ref == 0 and not node.children

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, depth first in child insertion order."""
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def all_slot_indices(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty()

    def reset(self) -> None:
        if locked := [n for n in self._nodes() if n.lock_ref > 0]:
            raise RuntimeError(f"cannot reset the radix cache: {len(locked)} node(s) locked")
        self.allocator.free(self.all_slot_indices())  # a no-op when empty
        self._reset_state()

    def pretty_print(self) -> str:
        lines = [f"{type(self).__name__}(total={self.total_size()}, evictable="
                 f"{self.evictable_size()}, protected={self.protected_size()}, clock={self._clock})"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(f"{'  ' * depth}{list(child.key)} -> {child.value.tolist()} "
                             f"lock={child.lock_ref} t={child.last_access} id={child.node_id}")
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)


class ChunkCache(RadixCache):
    """Stand-in for ``--disable-radix-cache``: caches nothing, shares nothing. ``insert`` counts
    every token as already held, so the caller frees every slot, as it frees a real tree's
    duplicates; every lookup, lock, eviction and size is the empty tree's."""

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        return len(key)

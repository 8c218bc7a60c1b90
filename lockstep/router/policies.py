"""Routing policies of the router: which worker serves a request.

- `round_robin`: the healthy workers in turn.
- `random`: uniformly at random (seeded, so a run can be replayed).
- `power_of_two`: two workers at random, the one with fewer requests in flight.
- `cache_aware`: SGLang router's rule (`lockstep.utils.cache_aware`) over a character radix tree
  per worker of the request texts sent there (prompt, chat messages as one string, or input ids
  as numbers), LRU-bounded to `max_tree_size` characters; load = requests in flight.

A policy sees only its candidates (healthy workers not yet tried), `.url` and `.load`; no I/O."""

from __future__ import annotations

import heapq
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

from lockstep.utils.cache_aware import CacheAwareRule

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


class WorkerLike(Protocol):
    url: str
    load: int


def _common_prefix(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of `edge` and `text[start:]` (slice compares run in C)."""
    n = min(len(edge), len(text) - start)
    if edge[:n] == text[start:start + n]:
        return n
    lo, hi = 0, n - 1  # the answer is in [lo, hi]: edge[:lo] matches, edge[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[:mid] == text[start:start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("children", "text", "parent", "last_access")

    def __init__(self, text: str, parent: _Node | None, tick: int) -> None:
        self.children: dict[str, _Node] = {}
        self.text = text
        self.parent = parent
        self.last_access = tick


class RadixTree:
    """A character radix tree with LRU eviction by leaves; `size` counts the characters held."""

    def __init__(self, max_size: int | None = None) -> None:
        self.root = _Node("", None, 0)
        self.size = 0
        self.max_size = max_size
        self._tick = 0

    def match(self, text: str) -> int:
        """Characters of `text` covered by the longest prefix in the tree (read-only)."""
        node, i = self.root, 0
        while i < len(text):
            if (child := node.children.get(text[i])) is None:
                break
            common = _common_prefix(child.text, text, i)
            i += common
            if common < len(child.text):
                break
            node = child
        return i

    def insert(self, text: str) -> None:
        """Add `text`, refreshing the access time of its whole path; evict if over the bound."""
        self._tick += 1
        tick = self._tick
        node, i = self.root, 0
        node.last_access = tick
        while i < len(text):
            if (child := node.children.get(text[i])) is None:
                node.children[text[i]] = _Node(text[i:], node, tick)
                self.size += len(text) - i
                break
            common = _common_prefix(child.text, text, i)
            if common < len(child.text):  # split the edge at the divergence
                mid = _Node(child.text[:common], node, tick)
                child.text = child.text[common:]
                child.parent = mid
                mid.children[child.text[0]] = child
                node.children[text[i]] = mid
                child = mid
            child.last_access = tick
            node = child
            i += common
        if self.max_size is not None and self.size > self.max_size:
            self.evict(int(self.max_size * 0.9))  # room for more before the next eviction

    def evict(self, target: int) -> int:
        """Drop least recently used leaves until at most `target` characters remain."""
        if self.size <= target:
            return 0
        heap: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                heap.append((node.last_access, id(node), node))
        heapq.heapify(heap)
        removed = 0
        while heap and self.size > target:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.text[0]]
            self.size -= len(leaf.text)
            removed += len(leaf.text)
            if not parent.children and parent is not self.root:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return removed

    def clear(self) -> None:
        self.root = _Node("", None, 0)
        self.size = 0


class Policy:
    name = "base"

    def select(self, candidates: Sequence[WorkerLike], text: str) -> WorkerLike:
        raise NotImplementedError

    def remove_worker(self, url: str) -> None:  # noqa: B027 - a no-op unless state is kept
        pass

    def clear(self) -> None:  # noqa: B027 - the workers' caches were flushed
        pass

    def info(self) -> dict[str, Any]:
        return {"policy": self.name}


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.counter = 0

    def select(self, candidates: Sequence[WorkerLike], text: str) -> WorkerLike:
        chosen = candidates[self.counter % len(candidates)]
        self.counter += 1
        return chosen


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int | None = 0) -> None:
        self.rng = random.Random(seed)

    def select(self, candidates: Sequence[WorkerLike], text: str) -> WorkerLike:
        return candidates[self.rng.randrange(len(candidates))]


class PowerOfTwo(RandomPolicy):
    name = "power_of_two"

    def select(self, candidates: Sequence[WorkerLike], text: str) -> WorkerLike:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(range(len(candidates)), 2)
        first, second = candidates[a], candidates[b]
        return second if second.load < first.load else first


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.0001, max_tree_size: int = 2 ** 24) -> None:
        self.rule = CacheAwareRule(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self.max_tree_size = max_tree_size
        self.trees: defaultdict[str, RadixTree] = defaultdict(lambda: RadixTree(max_tree_size))
        self.decisions = {"balance": 0, "cache_hit": 0, "cache_miss": 0}

    def select(self, candidates: Sequence[WorkerLike], text: str) -> WorkerLike:
        trees = [self.trees[w.url] for w in candidates]
        matched = [t.match(text) / len(text) if text else 0.0 for t in trees]
        i, why = self.rule.choose([w.load for w in candidates], matched, [t.size for t in trees])
        self.decisions[why] += 1
        if text:
            trees[i].insert(text)
        return candidates[i]

    def remove_worker(self, url: str) -> None:
        self.trees.pop(url, None)

    def clear(self) -> None:
        for tree in self.trees.values():
            tree.clear()

    def tree_sizes(self) -> dict[str, int]:
        return {url: tree.size for url, tree in self.trees.items()}

    def info(self) -> dict[str, Any]:
        return {"policy": self.name, "cache_threshold": self.rule.cache_threshold,
                "balance_abs_threshold": self.rule.abs_threshold,
                "balance_rel_threshold": self.rule.rel_threshold,
                "max_tree_size": self.max_tree_size, "decisions": dict(self.decisions),
                "tree_sizes": self.tree_sizes()}


def make_policy(name: str, seed: int | None = 0, **cache_aware: Any) -> Policy:
    """The policy `name`; `cache_aware` are CacheAware's parameters, `seed` the random ones'."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    make = {"cache_aware": lambda: CacheAware(**cache_aware), "round_robin": RoundRobin,
            "random": lambda: RandomPolicy(seed), "power_of_two": lambda: PowerOfTwo(seed)}
    return make[name]()


def _prompt_text(value: Any) -> str:
    """A prompt as text: a string, a list of ids, or (a batch) the first of a list of either."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        head = value[0]
        if isinstance(head, (str, list)):
            return _prompt_text(head)
        if isinstance(head, int) and not isinstance(head, bool):
            return " ".join(str(t) for t in value)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def routing_text(path: str, body: Any) -> str:
    """The text the cache-aware policy matches a request on ("" when there is none)."""
    if not isinstance(body, dict):
        return ""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}\n"
                       for m in messages if isinstance(m, dict))
    if path.endswith("/completions"):
        return _prompt_text(body.get("prompt"))
    text = _prompt_text(body.get("text"))
    return text or _prompt_text(body.get("input_ids"))

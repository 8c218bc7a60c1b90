"""Orders the waiting queue. Every policy is a pure function of the queue, the prefix tree and
a seeded RNG, so all ranks order it identically."""

from __future__ import annotations

import random
from collections import defaultdict

from lockstep.managers.schedule_batch import Req


def order_waiting(policy: str, waiting: list[Req], tree, rng: random.Random) -> list[Req]:
    if policy == "fcfs":
        return sorted(waiting, key=lambda r: r.arrival)
    if policy == "lof":
        return sorted(waiting, key=lambda r: (-r.sampling_params.max_new_tokens, r.arrival))
    if policy == "random":
        order = sorted(waiting, key=lambda r: r.arrival)
        rng.shuffle(order)
        return order
    if policy == "lpm":
        lens = {r.rid: int(tree.match_prefix(r.prefix_key)[0].numel()) for r in waiting}
        return sorted(waiting, key=lambda r: (-lens[r.rid], r.arrival))
    if policy == "dfs-weight":
        return _dfs_weight(waiting, tree)
    raise ValueError(f"unknown schedule policy {policy!r}")


def _dfs_weight(waiting: list[Req], tree) -> list[Req]:
    """Visit the prefix tree depth first, heaviest subtree (most waiting requests) first, so that
    requests sharing a prefix run together while that prefix is still cached."""
    by_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in sorted(waiting, key=lambda r: r.arrival):
        node = tree.match_prefix(req.prefix_key)[1]
        by_node[node.node_id].append(req)
        while node is not None:
            weight[node.node_id] += 1
            node = node.parent
    out: list[Req] = []
    stack = [tree.root]  # every matched node's chain of parents ends there
    while stack:
        node = stack.pop()
        out.extend(by_node.get(node.node_id, []))
        kids = [c for c in node.children.values() if c.node_id in weight]
        # Reverse of (heaviest, oldest key) order, since the stack pops from the end.
        kids.sort(key=lambda c: (weight[c.node_id], tuple(c.key[:1])))
        stack.extend(kids)
    return out

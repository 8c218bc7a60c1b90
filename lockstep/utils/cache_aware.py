"""SGLang's cache-aware choice, shared by the DP controller (replicas) and the router (servers).

The least loaded candidate when load is imbalanced (max - min > `abs_threshold` and max > min *
`rel_threshold`); else the best prefix match when it covers more than `cache_threshold` of the
request; else the candidate that has cached least, which spreads new prefixes (ties: less load)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheAwareRule:
    cache_threshold: float = 0.5
    abs_threshold: int = 32
    rel_threshold: float = 1.0001

    def choose(self, loads: Sequence[int], matched: Sequence[float], cached: Sequence[int]
               ) -> tuple[int, str]:
        """(index of the chosen candidate, why: "balance", "cache_hit" or "cache_miss")."""
        n = len(loads)
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            return min(range(n), key=lambda i: (loads[i], i)), "balance"
        best = max(range(n), key=lambda i: (matched[i], -loads[i], -i))
        if matched[best] > self.cache_threshold:
            return best, "cache_hit"
        return min(range(n), key=lambda i: (cached[i], loads[i], i)), "cache_miss"

"""SGLang's cache-aware choice, shared by the DP controller (replicas) and the router (servers).

Given each candidate's load, the share of the request's prefix it has cached, and the size of
its cache index:
  1. when the load is imbalanced (max - min > `abs_threshold` and max > min * `rel_threshold`),
     the least loaded candidate;
  2. else, when the best prefix match covers more than `cache_threshold` of the request, the
     candidate with that match (ties: the less loaded);
  3. else the candidate that has cached least (ties: the less loaded), which spreads new prefixes.
"""

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

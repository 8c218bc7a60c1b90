"""Time per token of the scheduler's stop checking (lockstep/managers/stop_checker.py) on hostile
input: 16 stop_regex patterns that backtracking engines take exponential time on, over an output of
the very text they choke on; the figure docs/reliability.md gives as the bound one request's stop
checking adds to a scheduler step.

    PYTHONPATH=. python benchmarks/stop_check_bench.py [--chars 4000] [--tokenizer PATH]

Without --tokenizer, one token is one character (the matching alone); with it, the real tokenizer's
incremental decode is counted too (a token is then several characters)."""

from __future__ import annotations

import argparse
import statistics
import time

from lockstep.managers.stop_checker import stop_checker
from lockstep.sampling_params import SamplingParams

HOSTILE = ["(a|aa)+b", "(a*)*b", "(a|a?)+c", "(a+)+b", "(.*a){12}x", "(a|a)+c", "a*a*a*a*b",
           "(aa|a)+?b", r"(\w+\s?)+x$", "(x+x+)+y", r"(a{1,10}){1,10}b$", "[ab]*a[ab]{12}c$",
           "(a|ab)*c", "(?s).*a.{30}b", "(a?){20}a{20}b", "(b|a+)+c$"]


class CharTokenizer:
    def decode(self, ids, **_kw) -> str:
        return "".join("a" for _ in ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=4000)
    ap.add_argument("--tokenizer", default=None, help="an HF tokenizer directory")
    a = ap.parse_args()
    if a.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer)
        ids = tok.encode("a" * a.chars, add_special_tokens=False)
    else:
        tok, ids = CharTokenizer(), [0] * a.chars
    cases = {"16 hostile stop_regex": {"stop_regex": HOSTILE},
             "16 stop strings of 64 chars": {"stop": ["a" * 63 + str(i % 10) for i in range(16)]},
             "none (decode only)": {"stop": ["\x00"]}}
    for name, params in cases.items():
        checker, error = stop_checker(tok, SamplingParams(**params))
        assert checker is not None, error
        times = []
        for t in ids:
            t0 = time.perf_counter()
            checker.push(t)
            times.append(time.perf_counter() - t0)
        assert checker.matched is None
        times.sort()
        print(f"{name:30s} tokens {len(ids):5d} mean {statistics.mean(times) * 1e6:7.0f} us  "
              f"p99 {times[int(len(times) * 0.99)] * 1e6:7.0f} us  max {times[-1] * 1e6:7.0f} us")


if __name__ == "__main__":
    main()

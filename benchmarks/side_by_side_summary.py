"""Ratios against a peer from serving_side_by_side.sh's JSON lines, as a markdown table.

    python benchmarks/side_by_side_summary.py serving_side_by_side.jsonl [--peer llama-server]

Each row is one server kind and workload (rounds side by side); the ratio columns divide lockstep's
figure by the peer's from the same round: median ITL (lower is better) and output tok/s (higher is
better). Load averages before and after each run are printed, since they are a figure's context.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl")
    ap.add_argument("--peer", default="llama-server")
    args = ap.parse_args()
    runs: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    with open(args.jsonl) as f:
        for line in f:
            rec = json.loads(line)
            kind, workload, rnd = rec["tag"].split("|")
            runs[(kind, workload)][rnd] = rec
    print("| server | workload | round | median ITL ms | output tok/s | median TTFT ms | load | "
          f"ITL / {args.peer} | tok/s / {args.peer} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (kind, workload), rounds in sorted(runs.items()):
        for rnd, rec in sorted(rounds.items()):
            peer = runs.get((args.peer, workload), {})
            base = peer.get(rnd) or next(iter(peer.values()), None)
            itl, tps = rec["median_itl_ms"], rec["output_throughput"]
            ratios = ("-", "-") if base is None or kind == args.peer else (
                f"{itl / base['median_itl_ms']:.2f}x", f"{tps / base['output_throughput']:.2f}x")
            print(f"| {kind} | {workload} | {rnd} | {itl:.1f} | {tps:.1f} | {rec['median_ttft_ms']:.0f} | "
                  f"{rec['load_avg_start']:.1f}-{rec['load_avg_end']:.1f} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()

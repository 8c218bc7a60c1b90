"""A PNG of per-user output tok/s per server kind and workload from serving_side_by_side.sh's JSON
lines (issue 22: with speculation, tokens come in bursts and median ITL says nothing).

    python benchmarks/side_by_side_plot.py serving_side_by_side.jsonl docs/side_by_side_per_user.png

Needs matplotlib (the `bench` extra: pip install -e '.[bench]'). One group of bars per workload,
one bar per kind, the mean over rounds with the rounds' range as an error bar and the value on top.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side_summary import load  # noqa: E402 - the one reader of the JSON lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl")
    ap.add_argument("png")
    ap.add_argument("--workloads", nargs="*", default=None, help="Default: every one in the file.")
    ap.add_argument("--title", default="Output tok/s per user (higher is better)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    runs = load(args.jsonl)
    workloads = args.workloads or sorted({w for _, w in runs})
    kinds = sorted({k for k, w in runs if w in workloads})
    width = 0.8 / max(1, len(kinds))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.45 * len(kinds) * len(workloads)), 4.5))
    for i, kind in enumerate(kinds):
        xs, ys, lo, hi = [], [], [], []
        for j, w in enumerate(workloads):
            vals = [r["per_user_output_throughput"] for r in runs.get((kind, w), {}).values()
                    if r.get("per_user_output_throughput")]
            if not vals:
                continue
            mean = sum(vals) / len(vals)
            xs.append(j + (i - (len(kinds) - 1) / 2) * width)
            ys.append(mean)
            lo.append(mean - min(vals))
            hi.append(max(vals) - mean)
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=kind)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("output tok/s per user")
    ax.set_title(args.title)
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

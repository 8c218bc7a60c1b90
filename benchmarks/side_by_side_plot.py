"""A PNG of per-user output tok/s per server kind and workload from serving_side_by_side.sh's JSON
lines (issue 22: with speculation, tokens come in bursts and median ITL says nothing), or with
`--ratios`, of each lockstep kind's figure over the peer's in the same round (issue 23's targets:
W-batch output tok/s, W-single median ITL, W-prefill median TTFT; per-user tok/s elsewhere).

    python benchmarks/side_by_side_plot.py serving_side_by_side.jsonl docs/side_by_side_per_user.png
    python benchmarks/side_by_side_plot.py serving_side_by_side.jsonl docs/side_by_side_ratios.png --ratios

Needs matplotlib (the `bench` extra: pip install -e '.[bench]'). One group of bars per workload,
one bar per kind, the mean over rounds with the rounds' range as an error bar and the value on top.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side_summary import load, same_round  # noqa: E402 - the one reader of the JSON lines

# workload -> (record field, label) of the ratio plot; other workloads: per-user output tok/s
RATIO_FIGURES = {"W-batch": ("output_throughput", "output tok/s"),
                 "W-single": ("median_itl_ms", "median ITL"),
                 "W-prefill": ("median_ttft_ms", "median TTFT")}
PER_USER = ("per_user_output_throughput", "per-user tok/s")


def ratio_bars(runs: dict, workloads: list[str], peer: str) -> dict[str, dict[str, list[float]]]:
    """{lockstep kind: {workload: [ratio per round]}}: the kind's figure over the peer's, same round."""
    out: dict[str, dict[str, list[float]]] = {}
    for (kind, w), rounds in runs.items():
        if not kind.startswith("lockstep") or w not in workloads or (peer, w) not in runs:
            continue
        field = RATIO_FIGURES.get(w, PER_USER)[0]
        for rnd, rec in rounds.items():
            base = same_round(runs[(peer, w)], rnd)
            if base and rec.get(field) and base.get(field):
                out.setdefault(kind, {}).setdefault(w, []).append(rec[field] / base[field])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl")
    ap.add_argument("png")
    ap.add_argument("--workloads", nargs="*", default=None, help="Default: every one in the file.")
    ap.add_argument("--title", default=None)
    ap.add_argument("--ratios", action="store_true",
                    help="Plot each lockstep kind's figure over --peer's, same round.")
    ap.add_argument("--peer", default="llama-server")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    runs = load(args.jsonl)
    workloads = args.workloads or sorted({w for _, w in runs})
    if args.ratios:
        series = ratio_bars(runs, workloads, args.peer)
        workloads = [w for w in workloads if any(w in v for v in series.values())]
    else:
        series = {}
        for (kind, w), rounds in runs.items():
            if w in workloads:
                vals = [r[PER_USER[0]] for r in rounds.values() if r.get(PER_USER[0])]
                if vals:
                    series.setdefault(kind, {})[w] = vals
    kinds = sorted(series)
    width = 0.8 / max(1, len(kinds))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.45 * len(kinds) * len(workloads)), 4.5))
    for i, kind in enumerate(kinds):
        xs, ys, lo, hi = [], [], [], []
        for j, w in enumerate(workloads):
            vals = series[kind].get(w)
            if not vals:
                continue
            mean = sum(vals) / len(vals)
            xs.append(j + (i - (len(kinds) - 1) / 2) * width)
            ys.append(mean)
            lo.append(mean - min(vals))
            hi.append(max(vals) - mean)
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=kind)
        ax.bar_label(bars, fmt="%.2f" if args.ratios else "%.0f", fontsize=7, padding=2)
    if args.ratios:
        ax.axhline(1.0, color="grey", linewidth=0.8)
        workload_labels = [f"{w}\n{RATIO_FIGURES.get(w, PER_USER)[1]}" for w in workloads]
        ax.set_ylabel(f"lockstep / {args.peer} (same round)")
        title = args.title or (f"lockstep over {args.peer}: tok/s above 1 is better, ITL and TTFT below 1")
    else:
        workload_labels = workloads
        ax.set_ylabel("output tok/s per user")
        title = args.title or "Output tok/s per user (higher is better)"
    ax.set_xticks(range(len(workloads)), workload_labels)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

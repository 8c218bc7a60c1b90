"""Ratios against a peer from serving_side_by_side.sh's JSON lines, as markdown tables.

    python benchmarks/side_by_side_summary.py serving_side_by_side.jsonl [--peer llama-server]

Each row is one server kind and workload (rounds side by side; a workload is named with its model
where the tag carries one); the ratio columns divide lockstep's figure by the peer's from the same
round: median ITL, median TPOT (from the token counts: (E2E - TTFT) / (tokens - 1), which holds
under speculation, where one streamed event carries several tokens) and median TTFT (lower is
better), output tok/s and per-user output tok/s (higher is better). Load averages before and after each run are printed, since they are
a figure's context.

Where the file holds a `lockstep-nospec` kind, a second table gives issue 22's figures: lockstep's
default (NGRAM speculation on a CPU) per-user tok/s against lockstep without speculation and against
the peer's best run, plain or with a `--spec-type` (`llama-server-SPEC`), on the same workload and round; median ITL, mean time per output token and
output tok/s against speculation off. Speculation sends tokens in bursts, so median ITL reads about 0
where it pays: per-user tok/s and mean TPOT ((E2E - TTFT) / (tokens - 1)) are the figures then.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

SPEC_KIND, PLAIN_KIND = "lockstep", "lockstep-nospec"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _per_user(rec: dict | None) -> float | None:
    return None if rec is None else rec.get("per_user_output_throughput")


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def load(path: str) -> dict[tuple[str, str], dict[str, dict]]:
    """{(kind, workload): {round: record}} from the tagged JSON lines."""
    runs: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            kind, workload, rnd, *model = rec["tag"].split("|")
            runs[(kind, " ".join([workload, *model]))][rnd] = rec
    return runs


def same_round(rounds: dict[str, dict], rnd: str) -> dict | None:
    """The record of round `rnd`, else the first one there is (a peer run in fewer rounds)."""
    return rounds.get(rnd) or next(iter(rounds.values()), None)


def peer_table(runs: dict[tuple[str, str], dict[str, dict]], peer: str) -> list[str]:
    out = ["| server | workload | round | median ITL ms | median TPOT ms | output tok/s | per-user tok/s "
           f"| median TTFT ms | load | ITL / {peer} | TPOT / {peer} | tok/s / {peer} | per-user / {peer} "
           f"| TTFT / {peer} |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (kind, workload), rounds in sorted(runs.items()):
        for rnd, rec in sorted(rounds.items()):
            base = None if kind == peer else same_round(runs.get((peer, workload), {}), rnd)
            itl, tps = rec["median_itl_ms"], rec["output_throughput"]
            ratios = ("-",) * 5 if base is None else (
                _ratio(itl, base["median_itl_ms"]), _ratio(rec["median_tpot_ms"], base["median_tpot_ms"]),
                _ratio(tps, base["output_throughput"]),
                _ratio(_per_user(rec), _per_user(base)),
                _ratio(rec["median_ttft_ms"], base["median_ttft_ms"]))
            out.append(f"| {kind} | {workload} | {rnd} | {itl:.1f} | {rec['median_tpot_ms']:.1f} | "
                       f"{tps:.1f} | {_fmt(_per_user(rec))} | {rec['median_ttft_ms']:.0f} | "
                       f"{rec['load_avg_start']:.1f}-{rec['load_avg_end']:.1f} | " + " | ".join(ratios)
                       + " |")
    return out


def spec_table(runs: dict[tuple[str, str], dict[str, dict]], peer: str) -> list[str]:
    """Issue 22's targets: lockstep (speculation on) against speculation off and against the peer's best
    --spec-type kind, per workload and round."""
    out = ["| workload | round | per-user tok/s spec / off | best peer run | per-user / best peer run "
           "| median ITL spec / off | mean TPOT spec / off | output tok/s spec / off | accept length |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (kind, workload), rounds in sorted(runs.items()):
        if kind != SPEC_KIND:
            continue
        for rnd, rec in sorted(rounds.items()):
            off = same_round(runs.get((PLAIN_KIND, workload), {}), rnd)
            peers = [(_per_user(same_round(r, rnd)) or 0.0, k) for (k, w), r in runs.items()
                     if w == workload and (k == peer or k.startswith(peer + "-"))]
            best_tps, best = max(peers, default=(None, None))
            vs_off = [_ratio(rec[name], None if off is None else off[name])
                      for name in ("median_itl_ms", "mean_tpot_ms", "output_throughput")]
            out.append(f"| {workload} | {rnd} | {_ratio(_per_user(rec), _per_user(off))} | "
                       f"{best or '-'} ({_fmt(best_tps)}) | {_ratio(_per_user(rec), best_tps)} | "
                       + " | ".join(vs_off) + f" | {_fmt(rec.get('spec_accept_length'), '.2f')} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl")
    ap.add_argument("--peer", default="llama-server")
    args = ap.parse_args()
    runs = load(args.jsonl)
    print("\n".join(peer_table(runs, args.peer)))
    if any(kind == PLAIN_KIND or kind.startswith(args.peer + "-") for kind, _ in runs):
        print("\n" + "\n".join(spec_table(runs, args.peer)))


if __name__ == "__main__":
    main()

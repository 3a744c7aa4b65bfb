"""Per-seed figures of speed-to-reward (docs/results.md 3b), recomputed from the stored results.json.gz:
final pass@1, eval pass@1 by step, training seconds and tokens to target (0.6), stream/re-prefill
ratios, the paired differences, and the common-mode fact survival.

    python docs/results/speed-to-reward/per_seed.py [docs/results/speed-to-reward/results.json.gz]
"""

import gzip
import json
import math
import statistics
import sys
from pathlib import Path

TARGET = 0.6
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # two-sided 95% t quantiles by degrees of freedom


def ci(xs):
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return f"{xs[0]:.3f}" if xs else "-"
    m, s = statistics.mean(xs), statistics.stdev(xs)
    return f"{m:.3f} ± {T95[len(xs) - 1] * s / math.sqrt(len(xs)):.3f} (n={len(xs)})"


def to_target(run):
    """Training seconds and tokens forwarded (sums over the steps up to it) at the first eval >= TARGET."""
    seconds = tokens = 0.0
    evals = {}
    for row in run["steps"]:
        if "eval/reward_mean" in row:
            evals[row["step"]] = row["eval/reward_mean"]
    reached = next((s for s in sorted(evals) if evals[s] >= TARGET), None)
    if reached is None:
        return None, None, evals
    for row in run["steps"]:
        if row.get("step", 0) <= reached and "time/step_seconds" in row:
            seconds += row["time/step_seconds"]
            tokens += row.get("tokens/forwarded", 0.0)
    return seconds, tokens, evals


def main(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        runs = json.load(f)["runs"]
    by = {(r["arm"], r["seed"]): r for r in runs}
    arms = sorted({r["arm"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    print(
        "arm | seed | pass@1 by eval step | final | train s | tokens fwd | s to 0.6 | tokens to 0.6 | "
        "common mode: pass@1, fact_survival"
    )
    for arm in arms:
        for s in seeds:
            r = by.get((arm, s))
            if r is None:
                continue
            sec, tok, evals = to_target(r)
            train_s = sum(x.get("time/step_seconds", 0.0) for x in r["steps"])
            common = r["evals"].get("stream markovian", {})
            print(
                f"{arm} | {s} | {' '.join(f'{v:.3f}' for _, v in sorted(evals.items()))} | "
                f"{r['final']['eval/reward_mean']:.3f} | {train_s:.0f} | {r['tokens_forwarded']:.0f} | "
                f"{'-' if sec is None else f'{sec:.0f}'} | {'-' if tok is None else f'{tok:.0f}'} | "
                f"{common.get('eval/reward_mean', float('nan')):.3f}, {common.get('fact_survival', float('nan')):.3f}"
            )
    pairs = [
        ("reprefill-markovian", "stream-markovian"),
        ("reprefill-sliding", "stream-sliding"),
        ("full", "stream-markovian"),
    ]
    for a, b in pairs:
        both = [s for s in seeds if (a, s) in by and (b, s) in by]
        if not both:
            continue
        ra, rb = [by[(a, s)] for s in both], [by[(b, s)] for s in both]
        secs = lambda r: sum(x.get("time/step_seconds", 0.0) for x in r["steps"])  # noqa: E731
        print(f"\n{a} vs {b}, seeds {both}")
        print(
            "  tokens ratio per seed:",
            [round(x["tokens_forwarded"] / y["tokens_forwarded"], 2) for x, y in zip(ra, rb)],
        )
        print("  train seconds ratio per seed:", [round(secs(x) / secs(y), 2) for x, y in zip(ra, rb)])
        d = [y["final"]["eval/reward_mean"] - x["final"]["eval/reward_mean"] for x, y in zip(ra, rb)]
        print(f"  final pass@1, {b} minus {a}, per seed:", [round(v, 3) for v in d], "mean ± 95% CI:", ci(d))
        ca = [x["evals"].get("stream markovian", {}).get("eval/reward_mean") for x in ra]
        cb = [y["evals"].get("stream markovian", {}).get("eval/reward_mean") for y in rb]
        if None not in ca + cb:
            dc = [v - u for u, v in zip(ca, cb)]
            print(f"  common mode pass@1, {b} minus {a}:", [round(v, 3) for v in dc], ci(dc))
        fa = [x["evals"].get("stream markovian", {}).get("fact_survival") for x in ra]
        fb = [y["evals"].get("stream markovian", {}).get("fact_survival") for y in rb]
        if None not in fa + fb:
            print(f"  common mode fact_survival, {b} minus {a}:", ci([v - u for u, v in zip(fa, fb)]))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("results.json.gz")))

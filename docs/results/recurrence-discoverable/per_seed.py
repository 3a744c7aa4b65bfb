"""Per-seed figures of recurrence-discoverable (docs/results.md 5b), recomputed from the stored
results.json.gz: reward in each arm's own mode before and after RL, and under compaction after RL,
with eval/env/carried (the share of episodes whose last state before the question held the fact);
the paired differences the predictions name.

    python docs/results/recurrence-discoverable/per_seed.py [docs/results/recurrence-discoverable/results.json.gz]
"""

import gzip
import json
import math
import statistics
import sys
from pathlib import Path

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # two-sided 95% t quantiles by degrees of freedom
CHANCE = 1 / 6


def ci(xs):
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:.3f}"
    return f"{m:.3f} ± {T95[len(xs) - 1] * statistics.stdev(xs) / math.sqrt(len(xs)):.3f} (n={len(xs)})"


def main(path: Path) -> None:
    with gzip.open(path, "rt") as f:
        runs = {(r["arm"], r["seed"]): r for r in json.load(f)["runs"]}
    seeds = sorted({s for _, s in runs})
    rows = {
        "own mode, before": lambda r: r["start"]["eval/reward_mean"],
        "own mode, after": lambda r: r["final"]["eval/reward_mean"],
        "own mode, gain": lambda r: r["final"]["eval/reward_mean"] - r["start"]["eval/reward_mean"],
        "own mode, carried after": lambda r: r["final"]["eval/env/carried"],
        "under compaction, reward": lambda r: r["evals"]["under compaction"]["eval/reward_mean"],
        "under compaction, carried": lambda r: r["evals"]["under compaction"]["eval/env/carried"],
    }
    for arm in ("markovian", "no-compaction"):
        print(f"\n{arm}, seeds {seeds}")
        for name, get in rows.items():
            xs = [get(runs[arm, s]) for s in seeds]
            print(f"  {name:27s} " + " ".join(f"{x:6.3f}" for x in xs) + f"   mean {ci(xs)}")
    m = [runs["markovian", s] for s in seeds]
    carried = [r["evals"]["under compaction"]["eval/env/carried"] for r in m]
    reward = [r["evals"]["under compaction"]["eval/reward_mean"] for r in m]
    print(f"\nmarkovian: carried < 0.04 on {sum(c < 0.04 for c in carried)} of {len(m)} seeds")
    print(
        f"markovian: reward under compaction within 0.1 of 1/6 on {sum(abs(x - CHANCE) <= 0.1 for x in reward)} of {len(m)}"
    )
    for key, label in (("eval/reward_mean", "reward"), ("eval/env/carried", "carried")):
        diff = [
            runs["markovian", s]["evals"]["under compaction"][key]
            - runs["no-compaction", s]["evals"]["under compaction"][key]
            for s in seeds
        ]
        print(
            f"markovian - no-compaction, {label} under compaction: "
            + " ".join(f"{x:+.4f}" for x in diff)
            + f"   mean {ci(diff)}"
        )


if __name__ == "__main__":
    here = Path(__file__).parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else here / "results.json.gz")

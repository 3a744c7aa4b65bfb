"""Per-seed figures of recall-rl (docs/results.md 7b), recomputed from the stored results.json.gz: each
arm's reward in its own setting before and after RL, the paired difference at step 40, and both
policies evaluated under compaction without recall (for the restored markovian runs of seeds 1-4 that
evaluation is recurrence-discoverable's "under compaction", the same configuration).

    python docs/results/recall-rl/per_seed.py [docs/results/recall-rl/results.json.gz]
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


def without_recall(run):
    evals = run["evals"]
    return evals.get("without recall") or evals["under compaction"]


def main(path: Path) -> None:
    with gzip.open(path, "rt") as f:
        runs = {(r["arm"], r["seed"]): r for r in json.load(f)["runs"]}
    seeds = sorted({s for _, s in runs})
    rows = {
        "before": lambda r: r["start"]["eval/reward_mean"],
        "after": lambda r: r["final"]["eval/reward_mean"],
        "gain": lambda r: r["final"]["eval/reward_mean"] - r["start"]["eval/reward_mean"],
        "recalls/episode after": lambda r: (
            r["final"]["eval/recalls_per_episode"] if "eval/recalls_per_episode" in r["final"] else 0.0
        ),
        "without recall: reward": lambda r: without_recall(r)["eval/reward_mean"],
        "without recall: carried": lambda r: without_recall(r)["eval/env/carried"],
    }
    for arm in ("markovian", "recall"):
        print(f"\n{arm}, seeds {seeds}")
        for name, get in rows.items():
            xs = [get(runs[arm, s]) for s in seeds]
            print(f"  {name:25s} " + " ".join(f"{x:6.3f}" for x in xs) + f"   mean {ci(xs)}")
    gains = [
        runs["recall", s]["final"]["eval/reward_mean"] - runs["recall", s]["start"]["eval/reward_mean"]
        for s in seeds
    ]
    print(f"\nrecall: gain >= +0.1 on {sum(g >= 0.1 for g in gains)} of {len(seeds)} seeds")
    diff = [
        runs["recall", s]["final"]["eval/reward_mean"] - runs["markovian", s]["final"]["eval/reward_mean"]
        for s in seeds
    ]
    print("recall - markovian at step 40: " + " ".join(f"{x:+.3f}" for x in diff) + f"   mean {ci(diff)}")
    wr = [without_recall(runs["recall", s]) for s in seeds]
    near = sum(abs(w["eval/reward_mean"] - CHANCE) <= 0.1 for w in wr)
    print(
        f"recall's policy without recall: within 0.1 of 1/6 on {near} of {len(seeds)}; carried < 0.04 on {sum(w['eval/env/carried'] < 0.04 for w in wr)}"
    )


if __name__ == "__main__":
    here = Path(__file__).parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else here / "results.json.gz")

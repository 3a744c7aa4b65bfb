"""Per-seed figures of recall-memory (docs/results.md 7), recomputed from the stored results.json.gz:
each arm's sampled reward, greedy reward, KV held, recalls and tokens forwarded per episode, and the
paired differences the predictions name.

    python docs/results/recall-memory/per_seed.py [docs/results/recall-memory/results.json.gz]
"""

import gzip
import json
import math
import statistics
import sys
from pathlib import Path

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # two-sided 95% t quantiles by degrees of freedom
ARMS = ("full", "markovian", "recall-archive", "recall-recompute")
FIGURES = {
    "reward": "eval/reward_mean",
    "greedy": "eval/reward_greedy",
    "kv held": "eval/kv/visible_max_mean",
    "recalls": "eval/recalls_per_episode",
    "tokens fed": "eval/tokens_forwarded_per_episode",
}


def ci(xs):
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:.3f}"
    return f"{m:.3f} ± {T95[len(xs) - 1] * statistics.stdev(xs) / math.sqrt(len(xs)):.3f} (n={len(xs)})"


def main(path: Path) -> None:
    with gzip.open(path, "rt") as f:
        runs = json.load(f)["runs"]
    by = {(r["arm"], r["seed"]): r["final"] for r in runs}
    seeds = sorted({s for _, s in by})
    for name, key in FIGURES.items():
        print(f"\n{name} ({key}), per seed {seeds}")
        for arm in ARMS:
            xs = [by[arm, s][key] for s in seeds if (arm, s) in by]
            print(f"  {arm:17s} " + " ".join(f"{x:7.3f}" for x in xs) + f"   mean {ci(xs)}")
    print("\npaired differences (per seed, then mean ± 95% t-interval)")
    pairs = [
        ("recall-archive - markovian", "recall-archive", "markovian", "eval/reward_mean"),
        ("full - recall-archive", "full", "recall-archive", "eval/reward_mean"),
        ("recall-archive - recall-recompute", "recall-archive", "recall-recompute", "eval/reward_mean"),
        ("kv: recall-archive - markovian", "recall-archive", "markovian", "eval/kv/visible_max_mean"),
        ("kv: full - recall-archive", "full", "recall-archive", "eval/kv/visible_max_mean"),
        (
            "fed: recompute - archive",
            "recall-recompute",
            "recall-archive",
            "eval/tokens_forwarded_per_episode",
        ),
        ("fed: archive - markovian", "recall-archive", "markovian", "eval/tokens_forwarded_per_episode"),
    ]
    for label, a, b, key in pairs:
        xs = [by[a, s][key] - by[b, s][key] for s in seeds if (a, s) in by and (b, s) in by]
        print(f"  {label:34s} " + " ".join(f"{x:+8.3f}" for x in xs) + f"   mean {ci(xs)}")


if __name__ == "__main__":
    here = Path(__file__).parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else here / "results.json.gz")

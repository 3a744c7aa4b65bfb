"""The figures of docs/results.md section 5c, from the stored runs (written before any run):

    python docs/results/recurrence-curriculum/analysis.py [RESULTS] > docs/results/recurrence-curriculum/analysis.txt

RESULTS defaults to results.json.gz beside this file. Two parts:
1. section 5b's per-seed figures (per_seed.py, reused as is): reward in each arm's own mode before and
   after RL, under compaction after RL, eval/env/carried, and the paired differences;
2. the curriculum's own: per seed, the training env/carried (the share of the step's 64 episodes whose
   last state before the question held the fact) averaged over each stage's last 5 steps (stage A:
   steps 15-19, the pre-registered statistic; stage B: 35-39; target: 75-79), and on how many seeds
   stage A's is below 0.05.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "recurrence-discoverable"))

import per_seed  # noqa: E402  (section 5b's script, reused as is)

WINDOWS = {
    "stage A (steps 15-19)": range(15, 20),
    "stage B (35-39)": range(35, 40),
    "target (75-79)": range(75, 80),
}


def carried_by_stage(path: Path) -> None:
    with gzip.open(path, "rt") as f:
        runs = {(r["arm"], r["seed"]): r for r in json.load(f)["runs"]}
    print(
        "\n## training env/carried, mean over each stage's last 5 steps (logged step s = training step s - 1)"
    )
    for arm in ("markovian", "no-compaction"):
        below = seeds = 0
        for seed in sorted(s for a, s in runs if a == arm):
            rows = {r["step"] - 1: r for r in runs[arm, seed]["steps"] if "env/carried" in r}
            means = {}
            for name, window in WINDOWS.items():
                values = [rows[s]["env/carried"] for s in window if s in rows]
                means[name] = sum(values) / len(values) if values else float("nan")
            seeds += 1
            below += means["stage A (steps 15-19)"] < 0.05
            print(f"{arm} seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))
        print(f"{arm}: stage A below 0.05 on {below} of {seeds} seeds")


def main(path: Path) -> None:
    per_seed.main(path)
    carried_by_stage(path)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results.json.gz")

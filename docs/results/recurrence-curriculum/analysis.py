"""The figures of docs/results.md section 5c, from the stored runs (written before any run):

    python docs/results/recurrence-curriculum/analysis.py [RESULTS] > docs/results/recurrence-curriculum/analysis.txt

RESULTS defaults to results.json.gz beside this file. Four parts:
1. section 5b's per-seed figures (per_seed.py, reused as is): reward in each arm's own mode before and
   after RL, under compaction after RL, eval/env/carried, and the paired differences;
2. the curriculum's own: per seed, the training env/carried (the share of the step's 64 episodes whose
   last state before the question held the fact) averaged over each stage's last 5 steps (stage A:
   steps 15-19, the pre-registered statistic; stage B: 35-39; target: 75-79), and on how many seeds
   stage A's is below 0.05;
3. each prediction of section 5c checked as written (held / not held), and the "reproduced if" test
   (added 2026-12-07 before any run had finished; parts 1-2 print the same figures);
4. post hoc (written after the runs): training reward per stage window, and the held-out reward at
   steps 0, 40 (the curriculum's end) and 80, mean ± 95% t over seeds.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "recurrence-discoverable"))

import per_seed  # noqa: E402  (section 5b's script, reused as is)

from kvstreams.stats import mean_interval  # noqa: E402

WINDOWS = {
    "stage A (steps 15-19)": range(15, 20),
    "stage B (35-39)": range(35, 40),
    "target (75-79)": range(75, 80),
}


def load_runs(path: Path) -> dict[tuple[str, int], dict]:
    with gzip.open(path, "rt") as f:
        return {(r["arm"], r["seed"]): r for r in json.load(f)["runs"]}


def window_mean(run: dict, key: str, window: range) -> float:
    """``key`` averaged over the training steps in ``window`` (logged step s = training step s - 1)."""
    rows = {r["step"] - 1: r[key] for r in run["steps"] if key in r}
    values = [rows[s] for s in window if s in rows]
    return statistics.mean(values) if values else float("nan")


def carried_by_stage(runs) -> dict[str, int]:
    """Prints the per-stage means; returns, per arm, on how many seeds stage A's is below 0.05."""
    counts = {}
    print(
        "\n## training env/carried, mean over each stage's last 5 steps (logged step s = training step s - 1)"
    )
    for arm in ("markovian", "no-compaction"):
        seeds = sorted(s for a, s in runs if a == arm)
        for seed in seeds:
            means = {name: window_mean(runs[arm, seed], "env/carried", w) for name, w in WINDOWS.items()}
            print(f"{arm} seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))
        counts[arm] = sum(
            window_mean(runs[arm, s], "env/carried", WINDOWS["stage A (steps 15-19)"]) < 0.05 for s in seeds
        )
        print(f"{arm}: stage A below 0.05 on {counts[arm]} of {len(seeds)} seeds")
    return counts


def verdicts(runs, stage_a_below: int) -> None:
    """The predictions of section 5c, each as written there."""
    under = "under compaction"
    seeds = sorted(s for a, s in runs if a == "markovian" and ("no-compaction", s) in runs)
    m = [runs["markovian", s] for s in seeds]
    n = [runs["no-compaction", s] for s in seeds]
    carried = [r["evals"][under]["eval/env/carried"] for r in m]
    reward = [r["evals"][under]["eval/reward_mean"] for r in m]
    gain = statistics.mean(r["final"]["eval/reward_mean"] - r["start"]["eval/reward_mean"] for r in n)
    n_carried = statistics.mean(r["final"]["eval/env/carried"] for r in n)
    diff = mean_interval(
        [
            a["evals"][under]["eval/reward_mean"] - b["evals"][under]["eval/reward_mean"]
            for a, b in zip(m, n, strict=True)
        ]
    )
    half = diff.half_width if diff.half_width is not None else math.inf
    print(f"\n## predictions (seeds {seeds})")
    print(f"markovian training carried at stage A (steps 15-19) < 0.05 on >= 3 seeds: {stage_a_below >= 3}")
    print(f"markovian carried under compaction < 0.04 on >= 3 seeds: {sum(c < 0.04 for c in carried) >= 3}")
    print(
        f"markovian reward under compaction within 0.1 of 1/6 on >= 3 seeds: "
        f"{sum(abs(x - per_seed.CHANCE) <= 0.1 for x in reward) >= 3}"
    )
    print(
        f"no-compaction own-mode gain >= 0.1 in the mean ({gain:+.3f}) with carried "
        f"< 0.02 ({n_carried:.3f}): {gain >= 0.1 and n_carried < 0.02}"
    )
    reproduced = sum(c >= 0.04 for c in carried) >= 3 and diff.mean - half > 0
    print(
        f"reproduced (carried >= 0.04 on >= 3 seeds and markovian - no-compaction reward under "
        f"compaction {diff.mean:+.3f} ± {half:.3f} above 0): {reproduced}"
    )


def post_hoc(runs) -> None:
    print("\n## post hoc: training reward/mean over each stage window, and held-out eval reward by step")
    for arm in ("markovian", "no-compaction"):
        seeds = sorted(s for a, s in runs if a == arm)
        for name, window in {"steps 0-4": range(0, 5), **WINDOWS}.items():
            xs = [window_mean(runs[arm, seed], "reward/mean", window) for seed in seeds]
            print(f"{arm} training reward, {name}: {per_seed.ci(xs)}")
        for step in (0, 40, 80):
            xs = [
                c["eval/reward_mean"]
                for seed in seeds
                for c in runs[arm, seed]["curve"]
                if c["step"] == step and "eval/reward_mean" in c
            ]
            print(f"{arm} eval reward at step {step}: {per_seed.ci(xs)}")


def main(path: Path) -> None:
    per_seed.main(path)
    runs = load_runs(path)
    verdicts(runs, carried_by_stage(runs)["markovian"])
    post_hoc(runs)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results.json.gz")

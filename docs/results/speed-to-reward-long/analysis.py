"""The figures of docs/results.md section 3c, from the stored runs (written before any of them ended):

    python docs/results/speed-to-reward-long/analysis.py [RESULTS] > docs/results/speed-to-reward-long/analysis.txt

RESULTS defaults to results.json.gz beside this file. Three parts:
1. section 3b's per-seed figures and paired differences, by 3b's own script (per_seed.py: eval pass@1
   by step, training seconds and tokens to the target 0.6, re-prefill / stream ratios, final paired
   differences, common mode);
2. the pre-registered gap question: per seed, stream - full context (each in its own mode) at step 40
   and at step 120, whether |gap| shrank, and the mean ± 95% t of each;
3. the reproducibility check: every evaluation at steps 0-40 against section 3b's stored run of the
   same arm and seed (equal to the last digit, or the first step that differs);
4. (added 2026-12-07, before any re-prefill run of this experiment ended, with the fix that evaluates
   a re-prefill run in re-prefill mode: 3b's re-prefill runs were evaluated in stream mode) the
   re-prefill arm's reproducibility on its *training* rewards, steps 0-40 (its evaluations now run in
   another mode than 3b's, so they cannot match), and its final pass@1 in its own mode against the
   common mode (stream), per seed and paired;
5. (added after reading the results, post hoc, not a prediction) each arm's start, final and gain in
   its own mode, and the paired difference of *gains* stream - re-prefill: the final difference could
   be where each starts rather than what RL did, since the same warm starts score lower served in
   re-prefill mode.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "speed-to-reward"))

import per_seed  # noqa: E402  (section 3b's script, reused as is)

from kvstreams.stats import mean_interval  # noqa: E402

KEY = "eval/reward_mean"


def load(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return {(r["arm"], r["seed"]): r for r in json.load(f)["runs"]}


def evals(run) -> dict[int, float]:
    return {row["step"]: row[KEY] for row in run["steps"] if KEY in row}


def gap_question(by: dict) -> None:
    print("\n## stream - full context (own modes), per seed: at step 40, at step 120")
    seeds = sorted(s for a, s in by if a == "stream-markovian" and ("full", s) in by)
    at40, at120, shrank = [], [], 0
    for s in seeds:
        st, fu = evals(by["stream-markovian", s]), evals(by["full", s])
        if 40 not in st or 40 not in fu or 120 not in st or 120 not in fu:
            print(f"seed {s}: not both at steps 40 and 120")
            continue
        g40, g120 = st[40] - fu[40], st[120] - fu[120]
        at40.append(g40)
        at120.append(g120)
        shrank += abs(g120) < abs(g40)
        print(f"seed {s}: {g40:+.3f} -> {g120:+.3f}")
    if at40:
        print(f"step 40: {mean_interval(at40).text()}; step 120: {mean_interval(at120).text()}")
        print(f"|gap| smaller at step 120 on {shrank} of {len(at40)} seeds")


def reproducibility(by: dict) -> None:
    print("\n## steps 0-40 against section 3b's runs (same arm and seed)")
    before = load(HERE.parent / "speed-to-reward" / "results.json.gz")
    for (arm, seed), run in sorted(by.items()):
        if (arm, seed) not in before:
            continue
        if arm.startswith("reprefill"):  # evaluated in stream mode in 3b: compare what it trained on
            now, then = training(run), training(before[arm, seed])
            arm = f"{arm} (training reward/mean)"
        else:
            now, then = evals(run), evals(before[arm, seed])
        steps = [s for s in sorted(then) if s <= 40 and s in now]
        differ = [s for s in steps if now[s] != then[s]]
        verdict = "equal" if not differ else f"first differs at step {differ[0]}"
        print(f"{arm} seed {seed}: steps {steps}: {verdict}")


def training(run) -> dict[int, float]:
    return {row["step"]: row["reward/mean"] for row in run["steps"] if "reward/mean" in row}


def reprefill_modes(by: dict) -> None:
    print("\n## re-prefill arm, final pass@1: own mode (re-prefill) vs common mode (stream)")
    diffs = []
    for (arm, seed), run in sorted(by.items()):
        if arm != "reprefill-markovian" or "stream markovian" not in run["evals"]:
            continue
        own, common = run["final"][KEY], run["evals"]["stream markovian"][KEY]
        diffs.append(own - common)
        print(f"seed {seed}: own {own:.3f}, common {common:.3f}, own - common {own - common:+.3f}")
    if diffs:
        print(f"own - common: {mean_interval(diffs).text()}")


def gains(by: dict) -> None:
    print("\n## post hoc: start, final and gain in each arm's own mode; paired gain differences")
    gain = {}
    for arm in ("full", "stream-markovian", "reprefill-markovian"):
        seeds = sorted(s for a, s in by if a == arm)
        start = [by[arm, s]["start"][KEY] for s in seeds]
        final = [by[arm, s]["final"][KEY] for s in seeds]
        gain[arm] = {s: f - b for s, b, f in zip(seeds, start, final, strict=True)}
        print(f"{arm}: start {mean_interval(start).text()}; final {mean_interval(final).text()}")
        print(
            f"  gain {mean_interval(list(gain[arm].values())).text()}: {[round(g, 3) for g in gain[arm].values()]}"
        )
    for a, b in (("stream-markovian", "reprefill-markovian"), ("stream-markovian", "full")):
        d = [gain[a][s] - gain[b][s] for s in sorted(set(gain[a]) & set(gain[b]))]
        print(f"gain {a} - {b}: {mean_interval(d).text()}: {[round(x, 3) for x in d]}")


def main(path: Path) -> None:
    per_seed.main(path)
    by = load(path)
    gap_question(by)
    reproducibility(by)
    reprefill_modes(by)
    gains(by)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results.json.gz")

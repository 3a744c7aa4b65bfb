"""The figures of docs/results.md section 3d, from the stored runs (written before any run):

    python docs/results/speed-preset/analysis.py [RESULTS] > docs/results/speed-preset/analysis.txt

RESULTS defaults to results.json.gz beside this file. First section 3b's per-seed script (eval pass@1
by step, training seconds and tokens, re-prefill / stream ratios per seed, final paired differences);
then what 3d adds: the start in each arm's own mode (paired), each arm's gain, the re-prefill-trained
model served in stream mode against its own mode, and each prediction checked as written. Paired by
seed; mean ± 95% t over seeds.
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
PAIRS = {
    "Markovian": ("stream-markovian", "reprefill-markovian"),
    "sliding": ("stream-sliding", "reprefill-sliding"),
}
RANGES = {
    "Markovian": {"tokens": (1.55, 1.80), "seconds": (1.1, 1.4)},
    "sliding": {"tokens": (4.3, 5.3), "seconds": (1.8, 2.8)},
}


def load(path: Path) -> dict:
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        return {(r["arm"], r["seed"]): r for r in json.load(f)["runs"]}


def text(values: list[float]) -> str:
    return mean_interval(values).text() + " (" + ", ".join(f"{v:+.3f}" for v in values) + ")"


def seconds(run) -> float:
    return sum(row.get("time/step_seconds", 0.0) for row in run["steps"])


def check(claim: str, held: bool) -> None:
    print(f"- {claim}: {'held' if held else 'NOT held'}")


def strategy(by: dict, name: str) -> None:
    stream, reprefill = PAIRS[name]
    seeds = sorted(s for a, s in by if a == stream and (reprefill, s) in by)
    if not seeds:
        return
    st, rp = [by[stream, s] for s in seeds], [by[reprefill, s] for s in seeds]
    tokens = [b["tokens_forwarded"] / a["tokens_forwarded"] for a, b in zip(st, rp, strict=True)]
    secs = [seconds(b) / seconds(a) for a, b in zip(st, rp, strict=True)]
    start = [a["start"][KEY] - b["start"][KEY] for a, b in zip(st, rp, strict=True)]
    final = [a["final"][KEY] - b["final"][KEY] for a, b in zip(st, rp, strict=True)]
    gains = {
        arm: [r["final"][KEY] - r["start"][KEY] for r in runs]
        for arm, runs in ((stream, st), (reprefill, rp))
    }
    common = [b["evals"]["stream"][KEY] - b["final"][KEY] for b in rp]
    print(f"\n## {name} preset, seeds {seeds}")
    print(f"re-prefill / stream tokens per seed: {', '.join(f'{t:.2f}' for t in tokens)}")
    print(f"re-prefill / stream training seconds per seed: {', '.join(f'{t:.2f}' for t in secs)}")
    print(f"start, stream - re-prefill (own modes): {text(start)}")
    for arm, values in gains.items():
        print(f"gain {arm}: {text(values)}")
    print(f"final, stream - re-prefill (own modes): {text(final)}")
    print(f"re-prefill arm served in stream mode minus its own mode: {text(common)}")
    lo, hi = RANGES[name]["tokens"]
    check(f"tokens ratio in [{lo}, {hi}] on every seed", all(lo <= t <= hi for t in tokens))
    lo, hi = RANGES[name]["seconds"]
    check(
        f"seconds ratio in [{lo}, {hi}] on every seed (read only on seeds without test runs beside)",
        all(lo <= t <= hi for t in secs),
    )
    if len(seeds) > 1:
        check("start |paired difference| < 0.1 in the mean", abs(mean_interval(start).mean) < 0.1)
        iv = mean_interval(final)
        check("final stream - re-prefill: interval contains 0", abs(iv.mean) <= (iv.half_width or 0))
        for arm, values in gains.items():
            check(f"{arm} gain below +0.15 in the mean", mean_interval(values).mean < 0.15)
        check(
            "re-prefill served in stream within 0.1 of its own mode (mean)",
            abs(mean_interval(common).mean) < 0.1,
        )


def main(path: Path) -> None:
    per_seed.main(path)
    by = load(path)
    for name in PAIRS:
        strategy(by, name)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results.json.gz")

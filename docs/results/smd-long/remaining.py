"""The figures of docs/results.md section 1b's second part (distillation, 50% dropped, full KV at 5
seeds), recomputed from the stored runs: python docs/results/smd-long/remaining.py

Statistics: gain = eval/reward_mean after 100 steps minus before (64 held-out tasks x 4 samples, under
the arm's own compression); dense = the same 256 episodes served without compression after training,
against the warm start's dense reward (warm_start_dense.json); differences paired by seed (same warm
start); mean ± 95% Student-t interval over seeds (kvstreams.stats.mean_interval).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from kvstreams.stats import mean_interval

HERE = Path(__file__).parent
KEY = "eval/reward_mean"


def load():
    runs = json.loads(gzip.decompress((HERE / "results.json.gz").read_bytes()))["runs"]
    dense_start = json.loads((HERE / "warm_start_dense.json").read_text())
    by = {(r["arm"], r["seed"]): r for r in runs}
    return by, {int(k): v[KEY] for k, v in dense_start.items()}


def fmt(values):
    iv = mean_interval(values)
    return f"{iv.mean:+.3f} ± {iv.half_width:.3f}" if len(values) > 1 else f"{values[0]:+.3f}"


def arm_rows(by, dense_start, arm):
    seeds = sorted(s for a, s in by if a == arm)
    gains = [by[arm, s]["final"][KEY] - by[arm, s]["start"][KEY] for s in seeds]
    dense = [by[arm, s]["evals"]["dense"][KEY] for s in seeds]
    change = [d - dense_start[s] for d, s in zip(dense, seeds, strict=True)]
    return seeds, gains, dense, change


def main() -> None:
    by, dense_start = load()
    print("arm | seeds | start | final | gain per seed | gain | dense after | dense change")
    for arm in ("shadow", "naive", "full-kv", "shadow-distill", "shadow-50", "naive-50"):
        seeds, gains, dense, change = arm_rows(by, dense_start, arm)
        if not seeds:
            continue
        start = [by[arm, s]["start"][KEY] for s in seeds]
        final = [by[arm, s]["final"][KEY] for s in seeds]
        print(
            f"{arm} | {seeds} | {fmt(start)} | {fmt(final)} | {', '.join(f'{g:+.3f}' for g in gains)} | "
            f"{fmt(gains)} | {min(dense):.3f}-{max(dense):.3f} | {fmt(change)} "
            f"(per seed {', '.join(f'{c:+.3f}' for c in change)})"
        )
    for a, b in (("shadow-distill", "shadow"), ("shadow-50", "naive-50")):
        seeds = sorted(s for x, s in by if x == a and (b, s) in by)
        final = [by[a, s]["final"][KEY] - by[b, s]["final"][KEY] for s in seeds]
        dense = [by[a, s]["evals"]["dense"][KEY] - by[b, s]["evals"]["dense"][KEY] for s in seeds]
        print(
            f"{a} - {b}, seeds {seeds}: final {fmt(final)} (per seed {', '.join(f'{d:+.3f}' for d in final)}); "
            f"dense {fmt(dense)} (per seed {', '.join(f'{d:+.3f}' for d in dense)})"
        )
    for arm in ("shadow", "full-kv", "shadow-distill", "shadow-50", "naive-50"):
        seeds = sorted(s for a, s in by if a == arm)
        for key in ("mismatch/ess", "mismatch/k3_kl", "clip/frac", "loss/distill", "entropy/mean"):
            values = [by[arm, s]["means"].get(key) for s in seeds]
            values = [v for v in values if v is not None]
            if values:
                print(f"{arm} mean over seeds of the run's mean {key}: {sum(values) / len(values):.3g}")


if __name__ == "__main__":
    main()

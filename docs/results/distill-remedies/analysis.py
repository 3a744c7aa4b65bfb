"""The figures of docs/results.md section 1c, recomputed from the stored runs:
python docs/results/distill-remedies/analysis.py > docs/results/distill-remedies/analysis.txt

Statistics (as pre-registered in section 1c):
- gain = eval/reward_mean after 100 steps minus before (64 held-out tasks x 4 samples, under the arm's
  own compression); dense change = the same 256 episodes served without compression after training,
  minus the warm start's dense reward. The warm starts are smd-long's, bit for bit (same spec, same
  seeds; every run's start evaluation equals smd-long's to the last digit, checked below), so the
  warm start's dense reward is docs/results/smd-long/warm_start_dense.json.
- differences paired by seed; mean ± 95% Student-t interval over seeds (kvstreams.stats.mean_interval).
- distillation share of a run = mean over its steps of grad/distill_norm / (grad/pg_norm +
  grad/distill_norm); a step that computed no distillation (advantaged lambda 0) counts as 0.
- per-run Spearman rank correlation over steps between that per-step share and
  rollout/zero_variance_group_frac (average ranks for ties).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from kvstreams.stats import mean_interval

HERE = Path(__file__).parent
KEY = "eval/reward_mean"
ARMS = ("shadow", "distill", "distill-advantaged", "distill-kl", "distill-lr")


def load():
    runs = json.loads(gzip.decompress((HERE / "results.json.gz").read_bytes()))["runs"]
    smd = json.loads(gzip.decompress((HERE.parent / "smd-long" / "results.json.gz").read_bytes()))["runs"]
    smd_start = {r["seed"]: r["start"][KEY] for r in smd if r["arm"] == "shadow"}
    for r in runs:  # the warm starts are smd-long's: the start evaluations agree exactly
        assert r["start"][KEY] == smd_start[r["seed"]], (r["arm"], r["seed"])
    dense_start = json.loads((HERE.parent / "smd-long" / "warm_start_dense.json").read_text())
    return {(r["arm"], r["seed"]): r for r in runs}, {int(k): v[KEY] for k, v in dense_start.items()}


def smd_long_distill(dense_start) -> dict[int, float]:
    """Per seed: the dense change of smd-long's lambda-0.1 arm (section 1b's collapse)."""
    smd = json.loads(gzip.decompress((HERE.parent / "smd-long" / "results.json.gz").read_bytes()))["runs"]
    return {r["seed"]: r["evals"]["dense"][KEY] - dense_start[r["seed"]] for r in smd if r["arm"] == "shadow-distill"}


def fmt(values) -> str:
    if len(values) == 1:
        return f"{values[0]:+.3f}"
    iv = mean_interval(values)
    return f"{iv.mean:+.3f} ± {iv.half_width:.3f}"


def per_seed(values) -> str:
    return ", ".join(f"{v:+.3f}" for v in values)


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else float("nan")


def shares(run) -> list[float]:
    """Per step: the distillation gradient's share of the two terms' gradient norms."""
    out = []
    for s in run["steps"]:
        if "grad/pg_norm" not in s:  # the step-0 evaluation row
            continue
        d = s.get("grad/distill_norm") or 0.0
        p = s["grad/pg_norm"]
        out.append(d / (p + d) if p + d > 0 else 0.0)
    return out


def zero_variance(run) -> list[float]:
    return [s["rollout/zero_variance_group_frac"] for s in run["steps"] if "grad/pg_norm" in s]


def main() -> None:
    by, dense_start = load()
    seeds_of = {arm: sorted(s for a, s in by if a == arm) for arm in ARMS}
    print("## per arm: gain and dense change (mean ± 95% t over seeds; per seed)")
    change = {}
    for arm in ARMS:
        seeds = seeds_of[arm]
        if not seeds:
            continue
        gains = [by[arm, s]["final"][KEY] - by[arm, s]["start"][KEY] for s in seeds]
        change[arm] = {s: by[arm, s]["evals"]["dense"][KEY] - dense_start[s] for s in seeds}
        print(
            f"{arm} seeds {seeds}: gain {fmt(gains)} ({per_seed(gains)}); "
            f"dense change {fmt(list(change[arm].values()))} ({per_seed(change[arm].values())})"
        )
    print("\n## paired against shadow (same seed)")
    for arm in ARMS[1:]:
        seeds = [s for s in seeds_of[arm] if ("shadow", s) in by]
        if not seeds:
            continue
        final = [by[arm, s]["final"][KEY] - by["shadow", s]["final"][KEY] for s in seeds]
        dense = [change[arm][s] - change["shadow"][s] for s in seeds]
        within = sum(abs(d) <= 0.05 for d in dense)
        print(
            f"{arm} - shadow, seeds {seeds}: gain {fmt(final)} ({per_seed(final)}); dense change "
            f"{fmt(dense)} ({per_seed(dense)}); within 0.05 on {within} of {len(seeds)} seeds"
        )
    print(
        "\n## distillation share (mean over steps) and its Spearman correlation with the all-equal-group share"
    )
    for arm in ARMS[1:]:
        for s in seeds_of[arm]:
            run = by[arm, s]
            sh, zv = shares(run), zero_variance(run)
            print(
                f"{arm} seed {s}: share {sum(sh) / len(sh):.3f}, Spearman(share, zero-variance) "
                f"{spearman(sh, zv):+.3f}, dense change {change[arm][s]:+.3f}, "
                f"mean zero-variance share {sum(zv) / len(zv):.3f}"
            )
    post_hoc(by, change, dense_start)


def post_hoc(by, change, dense_start) -> None:
    """Comparisons chosen after seeing the results (labelled so in docs/results.md)."""
    print("\n## post hoc: paired against distill (same seed)")
    for arm in ("distill-advantaged", "distill-kl", "distill-lr"):
        seeds = sorted(s for a, s in by if a == arm and ("distill", s) in by)
        dense = [change[arm][s] - change["distill"][s] for s in seeds]
        print(f"{arm} - distill, seeds {seeds}: dense change {fmt(dense)} ({per_seed(dense)})")
    before = smd_long_distill(dense_start)
    seeds = sorted(s for s in before if s in change["distill"])
    print(
        "\n## post hoc: lambda 0.1 in smd-long (section 1b) and here, same seeds and settings "
        "(only the gradient's float rounding differs)"
    )
    print(f"smd-long shadow-distill dense change: {per_seed([before[s] for s in seeds])}")
    print(f"distill-remedies distill dense change: {per_seed([change['distill'][s] for s in seeds])}")


if __name__ == "__main__":
    main()

"""The figures of docs/results.md sections 1e and 1f, from the stored runs (written before any run):

    python docs/results/smd-70/analysis.py > docs/results/smd-70/analysis.txt

Needs, beside this file: results.json.gz (the runner's) and warm_start_dense.json (the warm starts
served dense on the runs' dense-evaluation episodes, measured after the runs with
``python scripts/start_probe.py smd-70 OUT 0 1 2 3 4 > warm_start_dense.json``).

Statistics, as pre-registered in section 1e: gain = eval/reward_mean after 100 steps minus before
(64 held-out tasks x 4 samples, under the arm's compression); dense change = the same episodes served
dense after training minus the warm start's dense reward; paired by seed; mean ± 95% t over seeds;
per-step metrics are each run's mean over its steps, then over seeds. Then each prediction, checked
as written. The helpers (fmt, run_mean, run_max, print_run_means) are section 1d's, loaded from its script.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from kvstreams.stats import mean_interval

HERE = Path(__file__).parent
KEY = "eval/reward_mean"
_spec = importlib.util.spec_from_file_location("smd_fixed", HERE.parent / "smd-fixed" / "analysis.py")
smd_fixed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smd_fixed)
fmt, run_mean, run_max, print_run_means = (
    smd_fixed.fmt,
    smd_fixed.run_mean,
    smd_fixed.run_max,
    smd_fixed.print_run_means,
)
GROUPS = {
    "70%": ("shadow", "sparse-rl", "naive"),
    "fixed cache 192 / 128 (1f)": ("shadow-fixed", "sparse-rl-fixed", "naive-fixed"),
    "50%": ("shadow-50", "sparse-rl-50", "naive-50"),
}


def load() -> tuple[dict, dict[int, float]]:
    runs = json.loads(gzip.decompress((HERE / "results.json.gz").read_bytes()))["runs"]
    dense = json.loads((HERE / "warm_start_dense.json").read_text())
    return {(r["arm"], r["seed"]): r for r in runs}, {int(k): v[KEY] for k, v in dense.items()}


def per_arm(by: dict, dense_start: dict[int, float], arm: str) -> tuple[dict, dict] | None:
    seeds = sorted(s for a, s in by if a == arm)
    if not seeds:
        return None
    gain = {s: by[arm, s]["final"][KEY] - by[arm, s]["start"][KEY] for s in seeds}
    change = {s: by[arm, s]["evals"]["dense"][KEY] - dense_start[s] for s in seeds}
    print(f"{arm} seeds {seeds}")
    print(f"  start {fmt([by[arm, s]['start'][KEY] for s in seeds])}")
    print(f"  gain {fmt(list(gain.values()))}")
    print(f"  dense change {fmt(list(change.values()))}")
    print_run_means(
        by,
        arm,
        seeds,
        (
            "mismatch/ess",
            "mismatch/k3_kl",
            "clip/frac",
            "correction/discarded_seq_frac",
            "correction/kept_token_frac",
            "correction/vetoed_seq_frac",
        ),
    )
    early = [early_ties(by[arm, s]) for s in seeds]
    print(
        f"  tied groups, steps 1-10 (mean over the steps), per seed: {', '.join(f'{t:.2f}' for t in early)}"
    )
    k3 = [run_max(by[arm, s], "mismatch/k3_kl") for s in seeds]
    ess = [min(st["mismatch/ess"] for st in by[arm, s]["steps"] if "mismatch/ess" in st) for s in seeds]
    print(
        f"  k3 KL max over all steps and seeds {max(k3):.3g}; ESS min over all steps and seeds {min(ess):.3g}"
    )
    return gain, change


def early_ties(run) -> float:
    values = [
        s["rollout/zero_variance_group_frac"] for s in run["steps"] if "rollout/zero_variance_group_frac" in s
    ]
    return sum(values[:10]) / len(values[:10])


def paired(x: dict, y: dict) -> list[float]:
    return [x[s] - y[s] for s in sorted(set(x) & set(y))]


def shadow_exact(by: dict, arm: str, seeds) -> bool:
    """The replay's mechanism: ESS 1 and k3 KL below 1e-12 at every logged step of every seed."""
    runs = [by[arm, s] for s in seeds]
    return all(run_max(r, "mismatch/k3_kl") < 1e-12 for r in runs) and all(
        st["mismatch/ess"] > 1 - 1e-9 for r in runs for st in r["steps"] if "mismatch/ess" in st
    )


def verdicts(gain: dict, change: dict, by: dict) -> None:
    """Each prediction of section 1e, as written (70% group; the 50% one where it ran)."""
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    check = lambda text, held: print(f"- {text}: {'held' if held else 'NOT held'}")  # noqa: E731
    sh, sp, na = (gain.get(a) for a in GROUPS["70%"])
    if sh:
        check("shadow gain >= +0.1 in the mean", mean(list(sh.values())) >= 0.1)
        check(
            "shadow dense change within 0.05 on >= 3 of 5 seeds",
            sum(abs(v) <= 0.05 for v in change["shadow"].values()) >= 3,
        )
    if na:
        check("naive gain <= +0.05 (mean)", mean(list(na.values())) <= 0.05)
        check("naive dense change below -0.3 (mean)", mean(list(change["naive"].values())) < -0.3)
        seeds = sorted(na)
        check(
            "naive run-mean ESS below 0.6 (mean over seeds)",
            mean([run_mean(by["naive", s], "mismatch/ess") for s in seeds]) < 0.6,
        )
        check(
            "naive run-mean k3 KL above 0.7 (mean over seeds)",
            mean([run_mean(by["naive", s], "mismatch/k3_kl") for s in seeds]) > 0.7,
        )
    if sp:
        check("Sparse-RL gain <= +0.05 (mean)", mean(list(sp.values())) <= 0.05)
        check(
            "Sparse-RL does not collapse: falls by > 0.1 on at most 1 seed",
            sum(v < -0.1 for v in sp.values()) <= 1,
        )
        if na:
            lo, hi = sorted((mean(list(change["naive"].values())), mean(list(change["shadow"].values()))))
            check(
                "Sparse-RL dense change between naive's and shadow's (means)",
                lo <= mean(list(change["sparse-rl"].values())) <= hi,
            )
    if sh and sp:
        check("shadow - Sparse-RL >= +0.06 (mean)", mean(paired(sh, sp)) >= 0.06)
    if sh and na:
        iv = mean_interval(paired(sh, na))
        check(
            "shadow - naive >= +0.06 with the interval above 0",
            iv.mean >= 0.06 and iv.mean - (iv.half_width or 0) > 0,
        )
    if sh and sp and na:
        check(
            "ordering shadow > Sparse-RL >= naive (mean gains)",
            mean(list(sh.values())) > mean(list(sp.values())) >= mean(list(na.values())),
        )
    if sh:
        check("mechanism: shadow ESS 1.000 and k3 below 1e-12 at every step", shadow_exact(by, "shadow", sh))
    if "naive-50" in change and "naive" in change:
        check(
            "naive-50 dense change less negative than naive's at 70% (mean of paired)",
            mean(paired(change["naive-50"], change["naive"])) > 0,
        )


def verdicts_fixed(gain: dict, change: dict, by: dict) -> None:
    """Each prediction of section 1f, as written (the `fixed` group)."""
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    check = lambda text, held: print(f"- {text}: {'held' if held else 'NOT held'}")  # noqa: E731
    sh, sp, na = (gain.get(a) for a in GROUPS["fixed cache 192 / 128 (1f)"])
    if sh:
        check("shadow gain >= +0.1 in the mean", mean(list(sh.values())) >= 0.1)
        check(
            "shadow dense change within 0.05 on >= 3 of 5 seeds",
            sum(abs(v) <= 0.05 for v in change["shadow-fixed"].values()) >= 3,
        )
        check(
            "mechanism: shadow ESS 1.000 and k3 below 1e-12 at every step",
            shadow_exact(by, "shadow-fixed", sh),
        )
    if sp:
        kept = [run_mean(by["sparse-rl-fixed", s], "correction/kept_token_frac") for s in sp]
        check("Sparse-RL kept-token share below 0.1 (mean over seeds of the run's mean)", mean(kept) < 0.1)
        check("Sparse-RL gain <= 0 (mean)", mean(list(sp.values())) <= 0)
    if na:
        check("naive gain <= +0.05 (mean)", mean(list(na.values())) <= 0.05)
        check("naive dense change below -0.1 (mean)", mean(list(change["naive-fixed"].values())) < -0.1)
        check(
            "naive run-mean ESS below 0.6 (mean over seeds)",
            mean([run_mean(by["naive-fixed", s], "mismatch/ess") for s in na]) < 0.6,
        )
    if sp and na:
        check(
            "Sparse-RL dense change below naive's (means)",
            mean(list(change["sparse-rl-fixed"].values())) < mean(list(change["naive-fixed"].values())),
        )
    if sh and na:
        iv = mean_interval(paired(sh, na))
        check(
            "shadow - naive >= +0.06 with the interval above 0",
            iv.mean >= 0.06 and iv.mean - (iv.half_width or 0) > 0,
        )
    if sh and sp:
        check("shadow - Sparse-RL >= +0.1 (mean)", mean(paired(sh, sp)) >= 0.1)


def main() -> None:
    by, dense_start = load()
    gain, change = {}, {}
    for group, arms in GROUPS.items():
        print(f"## {group} dropped (mean ± 95% t over seeds; per seed)")
        for arm in arms:
            got = per_arm(by, dense_start, arm)
            if got:
                gain[arm], change[arm] = got
    print("\n## paired (same seed)")
    for a, b in (
        ("shadow", "sparse-rl"),
        ("shadow", "naive"),
        ("sparse-rl", "naive"),
        ("shadow-fixed", "sparse-rl-fixed"),
        ("shadow-fixed", "naive-fixed"),
        ("shadow-50", "naive-50"),
    ):
        if a in gain and b in gain:
            print(
                f"{a} - {b}: gain {fmt(paired(gain[a], gain[b]))}; dense change {fmt(paired(change[a], change[b]))}"
            )
    print("\n## the predictions of section 1e")
    verdicts(gain, change, by)
    print("\n## the predictions of section 1f")
    verdicts_fixed(gain, change, by)


if __name__ == "__main__":
    main()

"""What an experiment writes: ``results.json`` (every run), ``results.md`` (tables of mean ± 95% CI
per arm, one per group) and PNG plots of the eval-reward curves.

Arms of the same seed share their starting model, so differences to the reference arm are taken
per seed (paired) before the interval is computed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstreams.atomic import write_json
from kvstreams.experiments.spec import Arm, ExperimentSpec
from kvstreams.stats import Interval, mean_interval

REWARD = "eval/reward_mean"
FINAL_EXTRA = ("eval/kv/visible_max_mean", "eval/recalls_per_episode", "eval/tokens_forwarded_per_episode")


def by_arm(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(results, key=lambda r: (r["arm"], r["seed"])):
        out[r["arm"]].append(r)
    return out


def _interval(values: list[float | None]) -> Interval | None:
    xs = [v for v in values if v is not None]
    return mean_interval(xs) if xs else None


def time_to_target(run: dict[str, Any], target: float) -> dict[str, float] | None:
    """Wall-clock seconds and tokens forwarded until the eval reward first reaches ``target``."""
    for point in run["curve"]:
        if point.get(REWARD, -1.0) >= target:
            return {"seconds": point["seconds"], "tokens": point["tokens"], "step": point["step"]}
    return None


def arm_summary(spec: ExperimentSpec, runs: list[dict[str, Any]], reference: list[dict[str, Any]] | None):
    """The figures of one arm over its seeds (each an :class:`Interval` as a dict, or None)."""
    row: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
    for key in (REWARD, "eval/reward_greedy"):
        iv = _interval([r["final"].get(key) for r in runs])
        row[f"final {key}"] = iv.as_dict() if iv else None
    for key in FINAL_EXTRA:  # what the evaluated episodes held and fed
        iv = _interval([r["final"].get(key) for r in runs])
        if iv:
            row[f"final {key}"] = iv.as_dict()
    start = _interval([r["start"].get(REWARD) for r in runs])
    row[f"start {REWARD}"] = start.as_dict() if start else None
    # pass@1 and pass@k (runs with eval.samples > 1) before and after training, and the pass@1 gain
    passes = sorted(
        {k for r in runs for k in r["final"] if k.startswith("eval/pass@") and not k.endswith("_ci")}
    )
    for key in passes:
        for when in ("start", "final"):
            iv = _interval([r[when].get(key) for r in runs])
            row[f"{when} {key}"] = iv.as_dict() if iv else None
    if "eval/pass@1" in passes:
        iv = _interval([_gain(r, "eval/pass@1") for r in runs])
        row["pass@1 gain"] = iv.as_dict() if iv else None
    gain = _interval([_gain(r) for r in runs])
    row["gain"] = gain.as_dict() if gain else None
    for key in sorted({k for r in runs for k in r["means"]}):
        iv = _interval([r["means"].get(key) for r in runs])
        row[key] = iv.as_dict() if iv else None
    for key in MAX_KEYS:  # a mean of per-step maxima hides the worst step: give that too
        values = [step[key] for r in runs for step in r.get("steps", []) if key in step]
        if values:
            row[f"{key} {MAX_OVER}"] = max(values)
    row["minutes"] = mean_interval([r["seconds"] / 60 for r in runs]).as_dict()
    for name in sorted({k for r in runs for k in r["evals"]}):
        for key in sorted({k for r in runs for k in r["evals"].get(name, {})}):
            iv = _interval([r["evals"].get(name, {}).get(key) for r in runs])
            row[f"{name}: {key}"] = iv.as_dict() if iv else None
    if reference is not None:
        ref = {r["seed"]: r for r in reference}
        diff = _interval([_diff(r, ref.get(r["seed"])) for r in runs])
        row["final vs reference (paired)"] = diff.as_dict() if diff else None
    if spec.target_reward is not None:
        row.update(_speed(runs, spec.target_reward, reference))
    if spec.kind == "evaluate":  # one evaluation per run: no start, no gain ("final" is that evaluation)
        row = {k: v for k, v in row.items() if not k.startswith("start ") and not k.endswith("gain")}
    return row


def _gain(run: dict[str, Any], key: str = REWARD) -> float | None:
    a, b = run["start"].get(key), run["final"].get(key)
    return None if a is None or b is None else b - a


def _diff(run: dict[str, Any], ref: dict[str, Any] | None) -> float | None:
    if ref is None or REWARD not in run["final"] or REWARD not in ref["final"]:
        return None
    return run["final"][REWARD] - ref["final"][REWARD]


def _speed(runs, target: float, reference) -> dict[str, Any]:
    """Time and tokens to the target reward, and their ratios to the reference arm's (paired)."""
    hits = [time_to_target(r, target) for r in runs]
    out: dict[str, Any] = {"reached target": f"{sum(h is not None for h in hits)}/{len(hits)}"}
    # the whole run's training cost (rollouts + updates, no evaluation), and its ratio to the reference
    ref_runs = {r["seed"]: r for r in reference or []}
    for unit, name in (("seconds", "train seconds"), ("tokens", "tokens forwarded")):
        out[name] = mean_interval([r["curve"][-1][unit] for r in runs]).as_dict()
        ratios = [
            r["curve"][-1][unit] / ref_runs[r["seed"]]["curve"][-1][unit]
            for r in runs
            if r["seed"] in ref_runs
        ]
        out[f"{name} / reference"] = mean_interval(ratios).as_dict() if ratios else None
    for unit in ("seconds", "tokens"):
        iv = _interval([h[unit] if h else None for h in hits])
        out[f"{unit} to target"] = iv.as_dict() if iv else None
    if reference is not None:
        ref = {r["seed"]: time_to_target(r, target) for r in reference}
        for unit in ("seconds", "tokens"):
            ratios = [
                h[unit] / ref[r["seed"]][unit] if h and ref.get(r["seed"]) else None
                for h, r in zip(hits, runs, strict=True)
            ]
            iv = _interval(ratios)
            out[f"{unit} to target / reference"] = iv.as_dict() if iv else None
    return out


def summarise(spec: ExperimentSpec, arms: list[Arm], results: list[dict[str, Any]]) -> dict[str, Any]:
    runs = by_arm(results)
    reference = runs.get(spec.reference_arm) if spec.reference_arm else None
    return {a.name: arm_summary(spec, runs[a.name], reference) for a in arms if runs.get(a.name)}


# The table's columns, in order, when present (everything is in results.json).
MAX_OVER = "(max over steps and seeds)"
MAX_KEYS = ("mismatch/abs_logprob_diff_max", "kv/peak_entries")  # also reported as their largest value
COLUMNS = (
    f"start {REWARD}",
    f"final {REWARD}",
    "final eval/reward_greedy",
    "gain",
    "final vs reference (paired)",
    *(f"final {k}" for k in FINAL_EXTRA),
    "reached target",
    "seconds to target",
    "seconds to target / reference",
    "tokens to target / reference",
    "train seconds",
    "train seconds / reference",
    "tokens forwarded / reference",
    "mismatch/k3_kl",
    "mismatch/ess",
    "clip/frac",
    "rollout/zero_variance_group_frac",
    "mismatch/abs_logprob_diff_max",
    f"mismatch/abs_logprob_diff_max {MAX_OVER}",
    "correction/discarded_seq_frac",
    "kv/saving",
    f"kv/peak_entries {MAX_OVER}",
    "loss/distill",
    "loss/distill_scale",
    "grad/pg_norm",
    "grad/distill_norm",
    "grad/kl_norm",
    "entropy/mean",
    "minutes",
)


_EVAL_DETAILS = ("_ci", "samples_per_task", "tasks")


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    present = {k for row in rows for k in row}
    # held-out evaluations ("NAME: figure"), without each single eval's own interval and sizes
    evals = sorted(k for k in present if ": " in k and not k.endswith(_EVAL_DETAILS))
    passes = sorted(k for k in present if " eval/pass@" in k and k.startswith("start "))
    passes = [c for k in passes for c in (k, k.replace("start ", "final ", 1))]
    passes += ["pass@1 gain"] if "pass@1 gain" in present else []
    return passes + [c for c in COLUMNS if c in present and c != "minutes"] + evals + ["minutes"]


def _cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict) and "mean" in value:
        mean, half = value["mean"], value["half_width"]
        fmt = ".2e" if 0 < abs(mean) < 1e-2 else f".{digits}f"
        return f"{mean:{fmt}}" + ("" if half is None else f" ± {half:{fmt}}")
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


FIGURES = (
    "Figures: mean ± 95% t-interval over seeds (paired by seed). A per-step metric (mismatch/, "
    "correction/, kv/, loss/, grad/, entropy/) is first averaged over each run's steps, so its column is "
    "the mean over seeds of that run mean (for a `..._max` metric: of the per-step maxima); a column "
    f"marked {MAX_OVER} is the single largest value logged at any step of any seed."
)


def markdown(
    spec: ExperimentSpec, arms: list[Arm], summary: dict[str, Any], command: str, unpaired: Sequence[int] = ()
) -> str:
    lines = [f"# {spec.title}", "", f"Reproduces: {spec.source}", "", f"Question: {spec.question}", ""]
    lines += [f"Command: `{command}`", "", FIGURES, "", *_unpaired_warning(unpaired)]
    for group in spec.groups(arms):
        members = [a for a in arms if group in a.groups and a.name in summary]
        if not members:
            continue
        columns = _columns([summary[a.name] for a in members])
        lines += [f"## {group}", "", "| arm | seeds | " + " | ".join(columns) + " |"]
        lines.append("|---" * (len(columns) + 2) + "|")
        for a in members:
            row = summary[a.name]
            cells = [_cell(row.get(c)) for c in columns]
            lines.append(f"| {a.label or a.name} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
        lines += ["", f"![{group}](reward_{group}.png)", ""]
    return "\n".join(lines)


def plot_curves(
    spec: ExperimentSpec, arms: list[Arm], results: list[dict[str, Any]], out: Path
) -> list[Path]:
    """Per group: eval reward (mean and 95% band over seeds) against steps, and for speed experiments
    against wall-clock seconds and tokens forwarded too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = by_arm(results)
    if spec.kind == "evaluate":
        return plot_arms(spec, arms, runs, out)
    axes_x = ["step", "seconds", "tokens"] if spec.target_reward is not None else ["step"]
    written = []
    for group in spec.groups(arms):
        members = [a for a in arms if group in a.groups and runs.get(a.name)]
        if not members:
            continue
        fig, axes = plt.subplots(1, len(axes_x), figsize=(5.5 * len(axes_x), 3.8), squeeze=False)
        for ax, x in zip(axes[0], axes_x, strict=True):
            for a in members:
                xs, means, lows, highs = _band(runs[a.name], x)
                line = ax.plot(xs, means, marker="o", markersize=3, label=a.label or a.name)[0]
                # rewards live in [0, 1]: the t-band of 3 seeds can reach beyond, the plot does not
                ax.fill_between(
                    xs,
                    [max(v, 0.0) for v in lows],
                    [min(v, 1.0) for v in highs],
                    color=line.get_color(),
                    alpha=0.12,
                )
                for r in runs[a.name]:  # every seed, thin: with 3 seeds the runs say more than the band
                    points = [p for p in r["curve"] if REWARD in p]
                    ax.plot(
                        [p[x] for p in points],
                        [p[REWARD] for p in points],
                        color=line.get_color(),
                        alpha=0.35,
                        linewidth=0.7,
                    )
            if spec.target_reward is not None:
                ax.axhline(spec.target_reward, color="grey", linestyle=":", linewidth=1)
            ax.set_xlabel(
                {"step": "step", "seconds": "wall-clock s (rollout + learner)", "tokens": "tokens forwarded"}[
                    x
                ]
            )
            ax.set_ylabel("eval reward (sampled): mean, 95% band, seeds")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        written.append(_save(fig, f"{spec.name}: {group}", out / f"reward_{group}.png"))
    return written


def plot_arms(spec: ExperimentSpec, arms: list[Arm], runs: dict[str, list[dict[str, Any]]], out: Path):
    """An ``evaluate`` experiment, per group: each arm's eval reward and KV held (the mean over episodes
    of the most entries a query saw), every seed a dot, the mean ± 95% interval a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (REWARD, "eval reward (sampled)"),
        ("eval/kv/visible_max_mean", "KV entries held (mean of max)"),
    ]
    written = []
    for group in spec.groups(arms):
        members = [a for a in arms if group in a.groups and runs.get(a.name)]
        if not members:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
        for ax, (key, label) in zip(axes[0], panels, strict=True):
            for x, a in enumerate(members):
                values = [r["final"][key] for r in runs[a.name] if key in r["final"]]
                if not values:
                    continue
                iv = mean_interval(values)
                ax.bar(x, iv.mean, color="C0", alpha=0.3, yerr=iv.half_width or 0.0, capsize=4)
                ax.scatter([x] * len(values), values, color="C0", s=12, zorder=3)
            ax.set_xticks(range(len(members)), [a.label or a.name for a in members], fontsize=7, rotation=15)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, axis="y")
        title = f"{spec.name}: {group} (dots: seeds; bars: mean ± 95% CI)"
        written.append(_save(fig, title, out / f"reward_{group}.png"))
    return written


def _save(fig, title: str, path: Path) -> Path:
    """Title, lay out, write and close one figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _band(runs: list[dict[str, Any]], x: str):
    """Eval points shared by the arm's runs: mean x, mean reward and its 95% interval."""
    per_step: dict[int, list[dict[str, float]]] = defaultdict(list)
    for r in runs:
        for p in r["curve"]:
            if REWARD in p:
                per_step[p["step"]].append(p)
    xs, means, lows, highs = [], [], [], []
    for step in sorted(per_step):
        points = per_step[step]
        iv = mean_interval([p[REWARD] for p in points])
        xs.append(sum(p[x] for p in points) / len(points))
        means.append(iv.mean)
        lows.append(iv.low if iv.low is not None else iv.mean)
        highs.append(iv.high if iv.high is not None else iv.mean)
    return xs, means, lows, highs


def check_runs(spec: ExperimentSpec, results: list[dict[str, Any]], quick: bool) -> dict[str, Any] | None:
    """The spec's check on every finished run (None when the spec has none, or it is off under
    --quick): per run its figures and verdict, and how many failed."""
    check = spec.check
    if check is None or (quick and not check.in_quick):
        return None
    runs = [
        {"arm": r["arm"], "seed": r["seed"], **check.verdict(r["start"], r["final"])}
        for r in sorted(results, key=lambda r: (r["arm"], r["seed"]))
    ]
    return {"rule": check.describe(), "runs": runs, "failed": sum(not r["passed"] for r in runs)}


def check_markdown(checks: dict[str, Any] | None) -> list[str]:
    if checks is None:
        return []
    n = len(checks["runs"])
    lines = ["## check", "", f"Rule: {checks['rule']}. **{n - checks['failed']} of {n} runs pass.**", ""]
    lines += ["| arm | seed | before | after | passes |", "|---|---|---|---|---|"]
    for r in checks["runs"]:
        before, after = (_cell(r[k]) if r[k] is None else f"{r[k]:.3f}" for k in ("before", "after"))
        lines.append(
            f"| {r['arm']} | {r['seed']} | {before} | {after} | {'yes' if r['passed'] else '**no**'} |"
        )
    return [*lines, ""]


def unpaired_seeds(results: list[dict[str, Any]]) -> list[int]:
    """Seeds whose arms started from different weights (the ``warm_start`` fingerprint each run
    records; runs from before it was recorded carry none and are not judged)."""
    seen: dict[int, set[str]] = defaultdict(set)
    for r in results:
        if r.get("warm_start"):
            seen[r["seed"]].add(r["warm_start"])
    return sorted(seed for seed, prints in seen.items() if len(prints) > 1)


def _unpaired_warning(seeds: Sequence[int]) -> list[str]:
    if not seeds:
        return []
    names = ", ".join(f"seed {s}" for s in seeds)
    which = "that seed" if len(seeds) == 1 else "those seeds"
    return [
        f"**Not paired: {names}.** The arms of {which} started from different weights (a warm start "
        f"rebuilt, e.g. on another machine): the paired differences of {which} compare different starts.",
        "",
    ]


def write_report(
    spec: ExperimentSpec,
    arms: list[Arm],
    results: list[dict[str, Any]],
    out: Path,
    command: str,
    checks: dict[str, Any] | None = None,
) -> dict:
    summary = summarise(spec, arms, results)
    unpaired = unpaired_seeds(results)
    payload = {"experiment": spec.name, "command": command, "summary": summary, "runs": results}
    payload["unpaired_seeds"] = unpaired
    if checks is not None:
        payload["checks"] = checks
    write_json(out / "results.json", payload)
    text = "\n".join([markdown(spec, arms, summary, command, unpaired), *check_markdown(checks)])
    (out / "results.md").write_text(text)
    payload["plots"] = [str(p) for p in plot_curves(spec, arms, results, out)]
    return payload

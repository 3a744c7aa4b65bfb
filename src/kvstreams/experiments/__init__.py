"""``kvstreams experiment NAME``: the papers' results as commands anyone can rerun.

Specs live in ``configs/experiments/`` (:mod:`.spec`); training experiments run their arms x seeds
through ``kvstreams train`` (:mod:`.runner`) and report mean ± 95% intervals (:mod:`.report`);
``is-variance`` is a probe without training (:mod:`.is_variance`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kvstreams.atomic import write_json
from kvstreams.experiments.report import check_runs, write_report
from kvstreams.experiments.runner import finished_runs, run_experiment
from kvstreams.experiments.spec import ExperimentSpec, available, load_spec

__all__ = ["ExperimentSpec", "available", "failed_checks", "load_spec", "run", "run_command"]


def run_command(
    name: str,
    quick: bool = False,
    seeds: int | None = None,
    out: str | None = None,
    restore: str | None = None,
    report_only: bool = False,
    overrides: list[str] | tuple[str, ...] = (),
    device: str | None = None,
) -> int:
    """``kvstreams experiment NAME``: run (or resume, or only report) it, print its report; exit status
    1 when runs failed the experiment's check. ``name`` ``list`` lists the experiments."""
    from kvstreams.experiments.runner import restore_runs
    from kvstreams.models import quiet_transformers
    from kvstreams.rollout import check_out
    from kvstreams.train.config import parse_override

    if name == "list":
        for listed in available():
            print(f"{listed:22s} {load_spec(listed).title}")
        return 0
    settings = dict(parse_override(item) for item in overrides)
    if device:
        settings["model.device"] = device
    spec = load_spec(name, settings)
    where = Path(out) if out else default_out(spec, quick)
    check_out(where)
    if restore:
        n = restore_runs(Path(restore), where)
        print(f"restored {n} finished runs from {restore} into {where}", file=sys.stderr)
    quiet_transformers()
    command = f"kvstreams experiment {name}" + " --quick" * quick + (f" --seeds {seeds}" if seeds else "")
    command += "".join(f" --set {item}" for item in overrides) + (f" --device {device}" if device else "")
    command += " --report-only" * report_only
    payload = run(spec, where, quick=quick, seeds=seeds, command=command, report_only=report_only)
    print((where / "results.md").read_text())
    print(f"results: {where / 'results.json'}; plots: {', '.join(payload['plots'])}")
    failed = failed_checks(payload)
    if failed:
        print(f"kvstreams experiment: {failed} runs failed the experiment's check", file=sys.stderr)
        return 1
    return 0


def default_out(spec: ExperimentSpec, quick: bool) -> Path:
    return Path("runs/experiments") / (f"{spec.name}-quick" if quick else spec.name)


def run(
    spec: ExperimentSpec, out: Path, quick: bool, seeds: int | None, command: str, report_only: bool = False
) -> dict[str, Any]:
    """Run (or finish) the experiment under ``out`` and write its report there; ``report_only``: run
    nothing, report the runs already finished (an experiment still under way, or restored)."""
    out.mkdir(parents=True, exist_ok=True)
    if spec.kind == "is_variance":
        return _run_probe(spec, out, quick, seeds, command)
    if spec.kind == "ladder":
        return _run_ladder(spec, out, quick, seeds, command, report_only)
    if report_only:
        results = finished_runs(spec, out, quick=quick, seeds=seeds)
    else:
        results = run_experiment(spec, out, quick=quick, seeds=seeds)
    checks = check_runs(spec, results, quick)
    return write_report(spec, spec.arms_to_run(quick), results, out, command, checks)


def failed_checks(payload: dict[str, Any]) -> int:
    """Runs that failed their experiment's check (every rung's, for a ladder)."""
    if "rungs" in payload:
        return sum(failed_checks(p) for p in payload["rungs"].values())
    return (payload.get("checks") or {}).get("failed", 0)


def _run_ladder(
    spec: ExperimentSpec, out: Path, quick: bool, seeds: int | None, command: str, report_only: bool
) -> dict:
    """Each rung (an experiment of its own, in ``OUT/RUNG``) in order, every one run even when an
    earlier one fails; one report with every rung's table and check."""
    payloads: dict[str, Any] = {}
    rungs: list[str] = []
    for name_or_path in spec.rungs:
        rung = load_spec(name_or_path, spec.overrides)
        name = rung.name
        print(f"{spec.name}: rung {name}", file=sys.stderr, flush=True)
        payloads[name] = run(rung, out / name, quick, seeds, f"{command} (rung {name})", report_only)
        rungs.append(_nested((out / name / "results.md").read_text(), name))
    failed = sum(failed_checks(p) for p in payloads.values())
    checked = [name for name, p in payloads.items() if "checks" in p]
    unchecked = [name for name in payloads if name not in checked]
    verdict = f"{failed} runs fail their check" if failed else "every checked run passes"
    verdict += f" (checked: {', '.join(checked) or 'none'}"
    where = " under --quick" if quick else ""
    verdict += f"; not checked{where}: {', '.join(unchecked)})" if unchecked else ")"
    text = [f"# {spec.title}", "", spec.question, "", f"**{verdict}.**", "", f"Command: `{command}`", ""]
    payload = {"experiment": spec.name, "command": command, "rungs": payloads, "failed": failed}
    write_json(out / "results.json", payload)
    (out / "results.md").write_text("\n".join([*text, *rungs]))
    payload["plots"] = [p for rung in payloads.values() for p in rung.get("plots", [])]
    return payload


def _nested(markdown: str, rung: str) -> str:
    """A rung's report inside the ladder's: headings one level down, plots found in the rung's folder."""
    lines = [f"#{line}" if line.startswith("#") else line for line in markdown.splitlines()]
    return "\n".join(lines).replace("](reward_", f"]({rung}/reward_") + "\n"


def _run_probe(spec: ExperimentSpec, out: Path, quick: bool, seeds: int | None, command: str) -> dict:
    """Tiny random models (one per seed), and SmolLM2-135M when converted (a sampling seed each)."""
    from kvstreams.experiments.is_variance import plot_probe, probe_model, summarise_probe
    from kvstreams.models import load_model
    from kvstreams.pretrained import default_dir
    from kvstreams.tiny import make_tiny_model

    n_seeds = seeds or (spec.quick.seeds if quick else spec.seeds)
    ws = spec.warm_start
    models: dict[str, list[str]] = {"tiny": []}
    for seed in range(n_seeds):
        path = out / "models" / f"tiny-seed-{seed}"
        if not (path / "config.json").is_file():
            kwargs = (
                {}
                if ws is None
                else {"arch": ws.arch, "layers": ws.layers, "hidden": ws.hidden, "heads": ws.heads}
            )
            make_tiny_model(path, seed=seed, **kwargs)
        models["tiny"].append(str(path))
    real = default_dir("smollm2", "float32")
    if spec.probe.real_model and not quick and (real / "config.json").is_file():
        models["SmolLM2-135M"] = [str(real)] * n_seeds
    replicates: dict[str, list[dict]] = {}
    for name, paths in models.items():
        replicates[name] = []
        for seed, path in enumerate(paths):
            done = out / "runs" / name / f"seed-{seed}.json"
            if not done.is_file():
                print(f"{spec.name}: {name}, seed {seed}", file=sys.stderr, flush=True)
                model, tokenizer = load_model(path)
                write_json(done, probe_model(model, tokenizer, spec, seed, quick))
            replicates[name].append(json.loads(done.read_text()))
    summaries = {name: summarise_probe(reps) for name, reps in replicates.items()}
    payload = {"experiment": spec.name, "command": command, "summary": summaries, "runs": replicates}
    write_json(out / "results.json", payload)
    (out / "results.md").write_text(_probe_markdown(spec, summaries, command))
    payload["plots"] = [str(plot_probe(summaries, out))]
    return payload


def _probe_markdown(spec: ExperimentSpec, summaries: dict[str, Any], command: str) -> str:
    lines = [f"# {spec.title}", "", f"Reproduces: {spec.source}", "", f"Command: `{command}`", ""]
    lines += [
        "| model | learner | length | Var(log w) | Var(w) | ESS fraction |",
        "|---|---|---|---|---|---|",
    ]
    for name, summary in summaries.items():
        for learner in ("dense", "shadow"):
            for length, figs in sorted(summary[learner].items(), key=lambda kv: int(kv[0])):
                cells = [_iv(figs[k]) for k in ("var_log_w", "var_w", "ess_frac")]
                lines.append(f"| {name} | {learner} | {length} | " + " | ".join(cells) + " |")
    lines += ["", "![importance-weight variance](is_variance.png)", ""]
    return "\n".join(lines)


def _iv(d: dict[str, Any]) -> str:
    half = d["half_width"]
    return f"{d['mean']:.3g}" + ("" if half is None else f" ± {half:.2g}")

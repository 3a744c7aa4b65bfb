"""Running an experiment: its arms x seeds through ``kvstreams train``, resumably.

Each run is ``kvstreams train`` itself (same code path, no experiment-only learner) in
``OUT/runs/ARM/seed-S``; a finished run leaves ``result.json`` and is never redone, an interrupted
one resumes from its last checkpoint. Groups run in the spec's order, each group's arms over every
seed (seed by seed), so an experiment stopped early still holds its earlier comparisons, paired.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvstreams.atomic import claim, release, sha256, write_json
from kvstreams.errors import KVStreamsError
from kvstreams.experiments.spec import Arm, ExperimentSpec
from kvstreams.train.checkpoint import latest_checkpoint
from kvstreams.train.metrics import read_metrics

CURVE_KEYS = ("eval/reward_mean", "eval/reward_greedy", "eval/pass@1", "reward/mean")
MEAN_KEYS = (  # averaged over a run's steps
    "mismatch/k3_kl",
    "mismatch/abs_logprob_diff_max",
    "mismatch/is_weight_std",
    "mismatch/ess",
    "correction/discarded_seq_frac",
    "correction/kept_token_frac",
    "clip/frac",
    "rollout/zero_variance_group_frac",
    "kv/saving",
    "loss/pg",
    "loss/distill",
    "loss/distill_scale",
    "grad/norm",
    "grad/pg_norm",  # train.term_grad_norms: each term's own gradient norm
    "grad/distill_norm",
    "grad/kl_norm",
    "entropy/mean",
    "response/length_mean",
)


def warm_start(spec: ExperimentSpec, seed: int, models: Path, quick: bool, log) -> str | None:
    """The starting model of every arm at ``seed``: a fixed directory, or a seeded tiny model + SFT
    on the environment's expert (made once, reused by every arm and by reruns); None while another
    process is making it."""
    if spec.model is not None:
        from kvstreams.pretrained import model_directory

        return model_directory(spec.model)
    ws = spec.warm_start
    assert ws is not None
    out = models / f"seed-{seed}"
    model = out / ("sft" if ws.sft else "base")
    done = model / ("sft.json" if ws.sft else "fresh.json")  # written last: the model is complete
    if not done.is_file() and not claim(out):
        return None  # another process is making it
    if done.is_file():
        release(out)
        return str(model)
    try:
        return _make_warm_start(spec, ws, seed, out, quick, log)
    finally:
        release(out)


def _make_warm_start(spec: ExperimentSpec, ws, seed: int, out: Path, quick: bool, log) -> str:
    from kvstreams.tiny import make_tiny_model
    from kvstreams.train.sft import sft

    log(f"warm start, seed {seed}: tiny {ws.arch} model" + (" + SFT on the expert" if ws.sft else ""))
    make_tiny_model(out / "base", arch=ws.arch, layers=ws.layers, hidden=ws.hidden, heads=ws.heads, seed=seed)
    if not ws.sft:
        write_json(out / "base" / "fresh.json", {"seed": seed, "arch": ws.arch})
        return str(out / "base")
    cfg = spec.arm_config(spec.warm_start_arm(), seed, str(out / "base"), out / "unused", quick)
    cfg.sft.base, cfg.sft.out, cfg.sft.seed = str(out / "base"), str(out / "sft"), seed
    if quick and spec.quick.sft_steps:
        cfg.sft.steps = spec.quick.sft_steps
    if ws.env_args is not None:
        cfg.rollout.env_args = dict(ws.env_args)
    summary = sft(cfg, show_progress=False, force=True)  # this directory is the runner's own
    stop = summary["stopped_at_reward"]
    at = (
        f", stopped at step {stop['step']} (validation reward {stop['validation_reward']:.3f})"
        if stop
        else ""
    )
    log(f"  SFT loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}{at}")
    return str(out / "sft")


def run_one(spec: ExperimentSpec, arm: Arm, seed: int, model: str, out: Path, quick: bool) -> dict[str, Any]:
    """Train one arm at one seed, evaluate it on the spec's held-out evaluations, summarise (an
    ``evaluate`` experiment: evaluate the starting model in the arm's setting, nothing trained)."""
    from kvstreams.loop import train

    if spec.kind == "evaluate":
        return evaluate_one(spec, arm, seed, model, out, quick)

    cfg = spec.arm_config(arm, seed, model, out, quick)
    t0 = time.perf_counter()
    if (out / "summary.json").is_file():  # trained, killed before its result was written
        summary = json.loads((out / "summary.json").read_text())
    else:
        resume = latest_checkpoint(out / "checkpoints") is not None
        summary = train(cfg, resume=resume, show_progress=False)
    seconds = time.perf_counter() - t0
    rows = _rows(out)
    extra = {e.name: _evaluate(spec, arm, seed, model, out, quick, e) for e in spec.evals}
    return {
        "arm": arm.name,
        "seed": seed,
        "seconds": seconds,
        "final": (summary.get("eval_after") or {}),
        "start": (summary.get("eval_before") or {}),
        "means": {k: _mean(rows, k) for k in MEAN_KEYS if any(k in r for r in rows)},
        "curve": _curve(rows),
        "tokens_forwarded": summary["tokens_forwarded"],
        "evals": extra,
    }


def evaluate_one(
    spec: ExperimentSpec, arm: Arm, seed: int, model: str, out: Path, quick: bool
) -> dict[str, Any]:
    """The starting model of ``seed`` on the held-out tasks (``train.eval_episodes`` x
    ``train.eval_samples``, and greedily) in the arm's setting. Every arm draws the same tasks and
    sampling seeds, so arms differ only in their setting (paired by task and by seed)."""
    from kvstreams.models import load_model
    from kvstreams.train.evaluation import evaluate
    from kvstreams.train.rollouts import RolloutSource

    cfg = spec.arm_config(arm, seed, model, out, quick)
    t0 = time.perf_counter()
    weights, tokenizer = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
    result = evaluate(RolloutSource(weights, tokenizer, cfg), cfg.train.eval_episodes, cfg.train.eval_samples)
    return {
        "arm": arm.name,
        "seed": seed,
        "seconds": time.perf_counter() - t0,
        "final": result,
        "start": {},  # nothing was trained: one evaluation
        "means": {},
        "curve": [],
        "tokens_forwarded": result.get("eval/tokens_forwarded_per_episode", 0.0),
        "evals": {},
    }


def _curve(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step: the rewards logged, and the wall-clock seconds and tokens forwarded so far."""
    curve, seconds, tokens = [], 0.0, 0.0
    for r in rows:
        seconds += r.get("time/step_seconds", 0.0)
        tokens += r.get("tokens/forwarded", 0.0)
        point = {"step": r["step"], "seconds": seconds, "tokens": tokens}
        point.update({k: r[k] for k in CURVE_KEYS if k in r})
        curve.append(point)
    return curve


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values)


def _evaluate(spec, arm, seed, model, out, quick, evaluation) -> dict[str, float]:
    """The trained weights (the run's last checkpoint) on a held-out evaluation of the spec."""
    from safetensors.torch import load_model as load_weights

    from kvstreams.experiments.measures import measure
    from kvstreams.models import load_model
    from kvstreams.train.config import set_dotted, validate_config
    from kvstreams.train.evaluation import evaluate
    from kvstreams.train.rollouts import RolloutSource

    data = spec.arm_config(arm, seed, model, out, quick).model_dump(exclude_none=True)
    for key, value in evaluation.set.items():
        set_dotted(data, key, value)
    cfg = validate_config(data)
    weights, tokenizer = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
    load_weights(weights, str(latest_checkpoint(out / "checkpoints") / "model.safetensors"))
    n = evaluation.episodes or cfg.train.eval_episodes
    source = RolloutSource(weights, tokenizer, cfg, version=cfg.train.steps)
    result = evaluate(source, n, cfg.train.eval_samples)
    result.update(measure(evaluation.measure, source, n) if evaluation.measure else {})
    return result


def fingerprint(model: str) -> str | None:
    """The first 16 hex digits of the SHA-256 of a model directory's weights (its ``*.safetensors``,
    in name order), recorded in each result: arms of one seed are paired only if they started from the
    same weights, and a warm start rebuilt on another machine can differ (float rounding)."""
    files = sorted(Path(model).glob("*.safetensors"))
    return sha256(*files)[:16] if files else None


def plan_runs(spec: ExperimentSpec, quick: bool, n_seeds: int) -> list[tuple[Arm, int]]:
    """The order of the runs: group by group in the spec's order, each group's arms over every seed
    (seed by seed), an arm in several groups with the first; an experiment stopped early has its
    earlier groups complete and paired."""
    arms = spec.arms_to_run(quick)
    plan: list[tuple[Arm, int]] = []
    placed: set[str] = set()
    for group in spec.groups(arms):
        members = [a for a in arms if group in a.groups and a.name not in placed]
        placed.update(a.name for a in members)
        plan += [(a, s) for s in range(n_seeds) for a in members]
    return plan


def finished_runs(spec: ExperimentSpec, out: Path, quick: bool = False, seeds: int | None = None):
    """The results of the runs of ``spec`` already finished under ``out``, in plan order (nothing runs)."""
    n_seeds = seeds or (spec.quick.seeds if quick else spec.seeds)
    runs = [out / "runs" / arm.name / f"seed-{seed}" for arm, seed in plan_runs(spec, quick, n_seeds)]
    return [load_result(r) for r in runs if (r / "result.json").is_file()]


def run_experiment(
    spec: ExperimentSpec, out: Path, quick: bool = False, seeds: int | None = None
) -> list[dict[str, Any]]:
    """Every arm x seed of ``spec`` under ``out``; returns the finished runs' results. Several
    processes may work on one experiment: each run (and each warm start) is claimed with a lock file,
    a run another live process holds is left to it, one whose holder died is taken over (it resumes
    from its checkpoint). Rerun the command once they are all done for the complete report."""
    n_seeds = seeds or (spec.quick.seeds if quick else spec.seeds)
    plan = plan_runs(spec, quick, n_seeds)
    started = time.perf_counter()
    waiting = True
    while waiting:  # a pass over the plan; runs whose warm start another process is making wait
        waiting = False
        for i, (arm, seed) in enumerate(plan):
            run_dir = out / "runs" / arm.name / f"seed-{seed}"
            if (run_dir / "result.json").is_file() or not claim(run_dir):
                continue
            if (run_dir / "result.json").is_file():  # finished by another process while we looked
                release(run_dir)
                continue
            try:
                model = warm_start(spec, seed, out / "models", quick, _log)
                if model is None:
                    waiting = True
                    continue
                _log(f"[{i + 1}/{len(plan)}] {spec.name}: {arm.label or arm.name}, seed {seed}")
                result = {**run_one(spec, arm, seed, model, run_dir, quick), "warm_start": fingerprint(model)}
                write_json(run_dir / "result.json", result)
            finally:
                release(run_dir)
            final, start = result["final"].get("eval/reward_mean"), result["start"].get("eval/reward_mean")
            _log(
                f"  eval reward {_fmt(start)} -> {_fmt(final)} in {result['seconds']:.0f} s "
                f"({(time.perf_counter() - started) / 60:.1f} min so far)"
            )
        if waiting:
            time.sleep(5)
    return finished_runs(spec, out, quick, seeds)


def restore_runs(results: Path, out: Path) -> int:
    """Lay the finished runs of a stored report (``results.json`` or ``.json.gz``, e.g. the copy kept in
    ``docs/results/NAME/``) into ``out`` as if they had run there: ``result.json`` and ``metrics.jsonl``
    per run, so the experiment goes on with the runs still missing and reports all of them. A run
    already in ``out`` is left as it is. Returns how many were restored (every rung's, for a ladder)."""
    opener = gzip.open if results.suffix == ".gz" else open
    try:
        with opener(results, "rt") as f:
            payload = json.load(f)
    except (OSError, ValueError, EOFError) as err:
        raise KVStreamsError(f"--restore {str(results)!r}: cannot read it ({err})") from None
    if not isinstance(payload, dict) or not ("runs" in payload or "rungs" in payload):
        raise KVStreamsError(f"--restore {str(results)!r} is not an experiment's results.json")
    if "rungs" in payload:
        return sum(_restore(p, out / name) for name, p in payload["rungs"].items())
    return _restore(payload, out)


def _restore(payload: dict[str, Any], out: Path) -> int:
    restored = 0
    for run in payload.get("runs", []):
        run_dir = out / "runs" / run["arm"] / f"seed-{run['seed']}"
        if (run_dir / "result.json").is_file():
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        steps = run.get("steps", [])
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps))
        write_json(run_dir / "result.json", {k: v for k, v in run.items() if k != "steps"})
        restored += 1
    return restored


def load_result(run_dir: Path) -> dict[str, Any]:
    """A finished run's summary with every step's logged figures (``metrics.jsonl``)."""
    result = json.loads((run_dir / "result.json").read_text())
    result["steps"] = _rows(run_dir)
    return result


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return read_metrics(run_dir / "metrics.jsonl")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

"""An experiment's starting model evaluated before any RL: served dense (the before-figure of an
experiment's "dense" evaluation, which its runs take only after training), or under other settings
(to choose a setting from where its start sits, before any run). Same tasks, samples and sampling
seeds as the experiment's evaluations: the reference arm's config, then the ``dense`` evaluation's
overrides (unless ``--own``), then each ``--set``. Wrote docs/results/smd-long/warm_start_dense.json,
docs/results/real-grpo/start_dense.json and docs/results/smd-fixed/probes.json:

    python scripts/start_probe.py smd-long runs/experiments/smd-long 0 1 2 3 4 > warm_start_dense.json
    python scripts/start_probe.py real-grpo - 0 > start_dense.json
    python scripts/start_probe.py smd-long OUT 0 --own --set rollout.policy_args.budget=0.3
    python scripts/start_probe.py recurrence-curriculum OUT 0 --own --measure fact_survival \
        --set 'rollout.curriculum=[]' --set rollout.env_args.fact_turn=3 --set rollout.mode=stream \
        --set rollout.strategy_args.keep_tokens=40

OUT is the experiment's --out (its models/seed-S/sft are the warm starts; "-" for an experiment that
starts from a fixed ``model``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstreams.experiments import load_spec
from kvstreams.experiments.measures import measure
from kvstreams.models import load_model
from kvstreams.pretrained import model_directory
from kvstreams.train.config import parse_override, set_dotted, validate_config
from kvstreams.train.evaluation import evaluate
from kvstreams.train.rollouts import RolloutSource


def main(
    experiment: str, out: str, seeds: list[int], own: bool, sets: list[str], measures: list[str]
) -> dict[int, dict]:
    spec = load_spec(experiment)
    arm = next(a for a in spec.arms if a.name == (spec.reference_arm or spec.arms[0].name))
    dense = next((e for e in spec.evals if e.name == "dense"), None)
    if dense is None and not own:
        sys.exit(f"{experiment} has no 'dense' evaluation: pass --own")
    overrides = {} if own else dict(dense.set)
    overrides.update(parse_override(pair) for pair in sets)
    figures = {}
    for seed in seeds:
        model_dir = model_directory(spec.model) if spec.model else f"{out}/models/seed-{seed}/sft"
        data = spec.arm_config(arm, seed, model_dir, Path(out) / "unused", False).model_dump(
            exclude_none=True
        )
        for key, value in overrides.items():
            set_dotted(data, key, value)
        cfg = validate_config(data)
        model, tokenizer = load_model(model_dir)
        source = RolloutSource(model, tokenizer, cfg)
        n = (dense.episodes if dense else None) or cfg.train.eval_episodes
        figures[seed] = evaluate(source, n, cfg.train.eval_samples)
        for name in measures:  # e.g. fact_survival: is the fact still in view at the question?
            figures[seed].update(measure(name, source, n))
        print(f"seed {seed}: {figures[seed]['eval/reward_mean']:.3f}", file=sys.stderr, flush=True)
    return figures


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("experiment")
    p.add_argument("out")
    p.add_argument("seeds", nargs="+", type=int)
    p.add_argument("--own", action="store_true", help="the reference arm's own rollout, not the dense eval's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--measure", action="append", default=[], help="an experiment measure, e.g. fact_survival")
    a = p.parse_args()
    print(json.dumps(main(a.experiment, a.out, a.seeds, a.own, a.set, a.measure), indent=1))

"""The starting model's held-out reward served dense: the before-figure of an experiment's "dense"
evaluation (its runs evaluate dense only after training). Same tasks, samples and sampling seeds as
that evaluation: the reference arm's config with the ``dense`` evaluation's overrides. Wrote
docs/results/smd-long/warm_start_dense.json and docs/results/real-grpo/start_dense.json:

    python scripts/dense_start.py smd-long runs/experiments/smd-long 0 1 2 3 4 > warm_start_dense.json
    python scripts/dense_start.py real-grpo - 0 > start_dense.json

OUT is the experiment's --out (its models/seed-S/sft are the warm starts; "-" for an experiment that
starts from a fixed ``model``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvstreams.experiments import load_spec
from kvstreams.models import load_model
from kvstreams.pretrained import model_directory
from kvstreams.train.config import set_dotted, validate_config
from kvstreams.train.evaluation import evaluate
from kvstreams.train.rollouts import RolloutSource


def main(experiment: str, out: str, seeds: list[int]) -> dict[int, dict[str, float]]:
    spec = load_spec(experiment)
    arm = next(a for a in spec.arms if a.name == (spec.reference_arm or spec.arms[0].name))
    dense = next(e for e in spec.evals if e.name == "dense")
    figures = {}
    for seed in seeds:
        model_dir = model_directory(spec.model) if spec.model else f"{out}/models/seed-{seed}/sft"
        data = spec.arm_config(arm, seed, model_dir, Path(out) / "unused", False).model_dump(
            exclude_none=True
        )
        for key, value in dense.set.items():
            set_dotted(data, key, value)
        cfg = validate_config(data)
        model, tokenizer = load_model(model_dir)
        source = RolloutSource(model, tokenizer, cfg)
        figures[seed] = evaluate(source, dense.episodes or cfg.train.eval_episodes, cfg.train.eval_samples)
        print(f"seed {seed}: {figures[seed]['eval/reward_mean']:.3f}", file=sys.stderr, flush=True)
    return figures


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]), indent=1))

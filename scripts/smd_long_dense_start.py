"""The warm starts' held-out reward with dense attention: the before-figure of smd-long's "dense"
evaluation (the runs evaluate dense only after training). Same tasks, samples and sampling seeds as
that evaluation (the full-kv arm's config). Wrote docs/results/smd-long/warm_start_dense.json:

    python scripts/smd_long_dense_start.py OUT SEED [SEED ...] > warm_start_dense.json

OUT is the experiment's --out (its models/seed-S/sft are the warm starts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvstreams.experiments import load_spec
from kvstreams.models import load_model
from kvstreams.train.evaluation import evaluate
from kvstreams.train.rollouts import RolloutSource


def main(out: str, seeds: list[int]) -> dict[int, dict[str, float]]:
    spec = load_spec("smd-long")
    arm = next(a for a in spec.arms if a.name == "full-kv")
    figures = {}
    for seed in seeds:
        model_dir = f"{out}/models/seed-{seed}/sft"
        cfg = spec.arm_config(arm, seed, model_dir, Path(out) / "unused", False)
        model, tokenizer = load_model(model_dir)
        source = RolloutSource(model, tokenizer, cfg)
        figures[seed] = evaluate(source, cfg.train.eval_episodes, cfg.train.eval_samples)
        print(f"seed {seed}: {figures[seed]['eval/reward_mean']:.3f}", file=sys.stderr, flush=True)
    return figures


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], [int(s) for s in sys.argv[2:]]), indent=1))

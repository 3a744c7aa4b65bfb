"""Share of GRPO-sized groups (group_size samples of one held-out task) whose rewards all tie, at a
warm start, under the spec's first arm with overrides (docs/results.md 1e; output: ties.json):

    python docs/results/smd-70/ties.py smd-70 OUT/models/seed-5/sft rollout.policy_args.budget=0.3

The seed of the arm's config is 5 (the probes' seed, not one of the experiment's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvstreams.experiments import load_spec
from kvstreams.models import load_model
from kvstreams.train.config import parse_override, set_dotted, validate_config
from kvstreams.train.rollouts import RolloutSource, evaluation_plan


def tied_share(experiment: str, model_dir: str, overrides: list[str], tasks: int = 64) -> dict:
    spec = load_spec(experiment)
    data = spec.arm_config(spec.arms[0], 5, model_dir, Path("unused"), False).model_dump(exclude_none=True)
    for pair in overrides:
        set_dotted(data, *parse_override(pair))
    cfg = validate_config(data)
    model, tokenizer = load_model(model_dir)
    g = cfg.rollout.group_size
    batch = RolloutSource(model, tokenizer, cfg).run(evaluation_plan(cfg, tasks, greedy=False, samples=g))
    groups = [batch.rewards[i * g : (i + 1) * g] for i in range(tasks)]
    return {
        "tasks": tasks,
        "samples": g,
        "tied_group_share": sum(len(set(x)) == 1 for x in groups) / tasks,
        "reward_mean": sum(batch.rewards) / len(batch.rewards),
        "overrides": overrides,
    }


if __name__ == "__main__":
    print(json.dumps(tied_share(sys.argv[1], sys.argv[2], sys.argv[3:])))

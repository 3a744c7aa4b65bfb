"""Share of GRPO-sized groups (group_size samples of one held-out task) whose rewards all tie, at a
warm start, under the spec's first arm with overrides (docs/results.md 1e; output: ties.json):

    python docs/results/smd-70/ties.py smd-70 OUT/models/seed-5/sft rollout.policy_args.budget=0.3
"""
import sys, json
from pathlib import Path
from kvstreams.experiments import load_spec
from kvstreams.models import load_model
from kvstreams.train.config import set_dotted, validate_config, parse_override
from kvstreams.train.rollouts import RolloutSource, evaluation_plan
spec = load_spec(sys.argv[1]); model_dir = sys.argv[2]
arm = spec.arms[0]
data = spec.arm_config(arm, 5, model_dir, Path("/tmp/unused"), False).model_dump(exclude_none=True)
for pair in sys.argv[3:]:
    k, v = parse_override(pair); set_dotted(data, k, v)
cfg = validate_config(data)
model, tok = load_model(model_dir)
n, g = 64, cfg.rollout.group_size
batch = RolloutSource(model, tok, cfg).run(evaluation_plan(cfg, n, greedy=False, samples=g))
groups = [batch.rewards[i * g:(i + 1) * g] for i in range(n)]
tied = sum(len(set(x)) == 1 for x in groups) / n
print(json.dumps({"tasks": n, "samples": g, "tied_group_share": tied, "reward_mean": sum(batch.rewards) / len(batch.rewards), "overrides": sys.argv[3:]}))

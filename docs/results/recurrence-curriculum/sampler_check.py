"""Evaluate one model on 32 held-out memory tasks in full or stream mode (docs/results.md 5c side finding):
run with two code versions on PYTHONPATH to compare their samplers."""
import sys, torch
torch.set_num_threads(1)
from kvstreams.train.config import load_config
from kvstreams.models import load_model
from kvstreams.train.evaluation import evaluate
from kvstreams.train.rollouts import RolloutSource
import kvstreams
model_dir, mode = sys.argv[1], sys.argv[2]
ov = [f'model.path="{model_dir}"', 'rollout.env="memory"', 'rollout.env_args={n_turns = 4, n_facts = 1, noise_words = 8}',
      'rollout.strategy="markovian"', 'rollout.max_reply_tokens=32', f'rollout.mode="{mode}"', 'rollout.group_size=8', 'rollout.prompts_per_step=8',
      'train.eval_seed=600000' ]
# strategy budget under both names' era
try:
    cfg = load_config(None, ov + ['rollout.strategy_args={token_budget = 200}'])
except Exception:
    cfg = load_config(None, ov + ['rollout.strategy_args={budget = 200}'])
model, tok = load_model(model_dir)
src = RolloutSource(model, tok, cfg)
r = evaluate(src, 32, samples=1, greedy=False)
print(kvstreams.__file__, mode, {k: r[k] for k in ("eval/reward_mean", "eval/tokens_forwarded_per_episode", "eval/env/carried") if k in r})

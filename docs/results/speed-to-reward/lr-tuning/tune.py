"""lr tuning for speed-to-reward (docs/results.md 3b): full-context arm, seed 5, 40 steps, eval every 10."""

import sys, time
from pathlib import Path
from kvstreams.experiments.spec import load_spec
from kvstreams.experiments import runner

lr = sys.argv[1]
spec = load_spec("speed-to-reward", None if lr == "ws" else {"optim.lr": float(lr)})
spec.evals = []  # the rule reads the training run's own eval (full context)
root = Path("/work/tune/out")
while (model := runner.warm_start(spec, 5, root / "models", False, print)) is None:
    time.sleep(20)
if lr == "ws":
    sys.exit(0)
arm = next(a for a in spec.arms if a.name == "full")
res = runner.run_one(spec, arm, 5, model, root / f"lr-{lr}", False)
print(res["final"])

"""Make an experiment's warm start for the given seeds, as its runner does (used to probe candidate
settings of smd-70 before choosing one; docs/results/smd-70/probes.json):

    python docs/results/smd-70/warm_start.py smd-70 OUT 5

writes OUT/models/seed-5/sft, which ``scripts/start_probe.py smd-70 OUT 5 ...`` then evaluates."""

import sys
from pathlib import Path

from kvstreams.experiments import load_spec
from kvstreams.experiments.runner import warm_start

if __name__ == "__main__":
    spec = load_spec(sys.argv[1])
    for seed in sys.argv[3:]:
        print(warm_start(spec, int(seed), Path(sys.argv[2]) / "models", False, print), flush=True)

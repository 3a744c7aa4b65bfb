"""Compaction alone vs compaction + compression on the tiny model (`memory`, 4 episodes of 40 turns,
the environment's budget B = 384), same seeds: `bench rollout`'s compose section for two strategies,
without its other sections. Writes compose.json next to this file.

    python docs/results/compose/bench_compose.py [MODELS_DIR]
"""

import sys
from pathlib import Path

from kvstreams.bench.rollout import Point, RolloutBenchSettings, bench_rollout

here = Path(__file__).parent
settings = RolloutBenchSettings(
    points=[Point("tiny", "memory", s) for s in ("sliding_window", "markovian")],
    full_context=False,
    compose=[("snapkv", 128), ("h2o", 128), ("streaming_llm", 128), ("snapkv", 0.5)],
)
models = sys.argv[1] if len(sys.argv) > 1 else str(Path.home() / ".cache" / "kvstreams" / "bench-models")
report = bench_rollout(settings, models, here)
report.save(here / "compose.json")
for section in report.sections:
    if section.rows and "policy" in section.columns:
        print(section.title)
        for row in section.rows:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})

"""Benchmarks of the two papers' efficiency claims (`kvstreams bench rollout|learner|decode`), the
real-model premise (`premise`), scale-out (`cluster`) and the machine's limit (`roofline`, with
llama.cpp as the bar).

Each bench runs the compared settings side by side in one process (ratios, not absolute times, are
what carries over between machines), prints tables, writes JSON and PNG plots, and records the
machine. ``docs/benchmarks.md`` holds the latest figures and how to read them.
"""

from kvstreams.bench.cluster import ClusterBenchSettings, bench_cluster
from kvstreams.bench.decode import DecodeBenchSettings, bench_decode
from kvstreams.bench.learner import LearnerBenchSettings, bench_learner
from kvstreams.bench.premise import PremiseBenchSettings, bench_premise
from kvstreams.bench.report import BenchReport, print_report
from kvstreams.bench.rollout import RolloutBenchSettings, bench_rollout
from kvstreams.bench.roofline import RooflineBenchSettings, bench_roofline

BENCHES = {
    "rollout": (RolloutBenchSettings, bench_rollout),
    "learner": (LearnerBenchSettings, bench_learner),
    "decode": (DecodeBenchSettings, bench_decode),
    "premise": (PremiseBenchSettings, bench_premise),
    "cluster": (ClusterBenchSettings, bench_cluster),
    "roofline": (RooflineBenchSettings, bench_roofline),
}
ALL = ("rollout", "learner", "decode")  # `bench all`; premise needs the real model (make bench-real)

__all__ = [
    "BENCHES",
    "BenchReport",
    "ClusterBenchSettings",
    "DecodeBenchSettings",
    "LearnerBenchSettings",
    "PremiseBenchSettings",
    "RolloutBenchSettings",
    "RooflineBenchSettings",
    "bench_cluster",
    "bench_decode",
    "bench_learner",
    "bench_premise",
    "bench_rollout",
    "bench_roofline",
    "print_report",
]

"""Benchmarks of the two papers' efficiency claims (`kvstreams bench rollout|learner|decode`), the
real-model premise (`premise`), scale-out (`cluster`) and the machine's limit (`roofline`, with
llama.cpp as the bar).

Each bench runs the compared settings side by side in one process (ratios, not absolute times, are
what carries over between machines), prints tables, writes JSON and PNG plots, and records the
machine. ``docs/benchmarks.md`` holds the latest figures and how to read them.
"""

from pathlib import Path

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


def settings_for(
    name: str,
    quick: bool,
    curve: bool = False,
    model: str | None = None,
    device: str | None = None,
    kvpress_python: str | None = None,
    llama_cpp: str | None = None,
):
    """The settings of bench ``name``: its preset (or ``quick``'s), with the command line's choices."""
    from kvstreams.errors import KVStreamsError

    settings_type, _ = BENCHES[name]
    settings = settings_type.curve(quick) if curve else settings_type.preset(quick)  # type: ignore[attr-defined]
    if model:
        settings = settings.on_model(model)
    if device:
        settings = settings.on_device(device)
    if name == "decode":
        settings.kvpress_python = kvpress_python
    if name == "roofline":
        settings.llama_cpp = llama_cpp
    elif llama_cpp:
        raise KVStreamsError("--llama-cpp is for bench roofline")
    return settings


def run_benches(
    which: str, quick: bool, out: Path, models: Path | None = None, json_path: str | None = None, **choices
) -> dict:
    """``kvstreams bench WHICH``: run each bench (``all``: :data:`ALL`), print its tables, save
    ``OUT/<bench>[-quick].json`` (and ``json_path``); the reports by name. ``choices``: see
    :func:`settings_for`."""
    from kvstreams.atomic import write_json
    from kvstreams.bench.report import pin_allocator
    from kvstreams.errors import KVStreamsError
    from kvstreams.models import quiet_transformers
    from kvstreams.rollout import check_json, check_out

    check_json(json_path)
    if which != "cluster":  # before anything is allocated: peak-memory figures depend on it
        # (not for cluster: its actors run on the default allocator, and a fixed mmap threshold makes
        # every large tensor an mmap/munmap, which would slow the in-process rows it compares them to)
        pin_allocator()
    quiet_transformers()
    check_out(out)
    if choices.get("curve") and which != "rollout":
        raise KVStreamsError("--curve is for bench rollout")
    if choices.get("device") and which != "cluster":
        raise KVStreamsError("--device is for bench cluster")
    reports = {}
    for name in list(ALL) if which == "all" else [which]:
        settings = settings_for(name, quick, **choices)
        report = BENCHES[name][1](settings, models or out / "models", out)
        label = "rollout-curve" if choices.get("curve") else name
        report.settings["quick"] = quick
        report.save(out / f"{label}{'-quick' if quick else ''}.json")
        print_report(report)
        reports[label] = report.as_dict()
    if json_path:
        write_json(Path(json_path), reports if len(reports) > 1 else next(iter(reports.values())))
    return reports


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
    "run_benches",
    "settings_for",
]

"""`kvstreams bench cluster`: what scale-out buys on this machine (docs/scale-out.md).

Side by side in one process, on the same batch: rollouts in the trainer's process and on 1 and 2
Ray rollout workers (the same episodes: the tokens are checked equal), and the learner step in the
trainer's process and on 1 and 2 FSDP2 ranks (the same loss and gradient norm: checked). Actor
start-up (a Python process importing torch and transformers, loading the model) is reported apart
from the per-batch time. Every process, the trainer's included, runs torch on one thread per CPU
Ray reserves for a worker or rank (1 by default). On a 2-core CPU the workers and ranks share the cores the single process
already used, so the ratios say what the overheads cost, not what more hardware would give; the
same command with ``--device cuda`` on a machine with one GPU per worker and rank measures that.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstreams.bench.models import bench_model
from kvstreams.bench.report import BenchReport, Target, progress_bar, save_figure


@dataclass
class ClusterBenchSettings:
    model: str = "tiny"
    device: str = "cpu"
    prompts: int = 8  # GRPO groups per batch
    group_size: int = 4
    n_turns: int = 6
    workers: list[int] = field(default_factory=lambda: [1, 2])
    ranks: list[int] = field(default_factory=lambda: [1, 2])
    batches: int = 3  # rollout batches per setting (the first one also warms up)
    learner_steps: int = 3  # timed steps per setting, after one warm-up step
    seed: int = 0

    @classmethod
    def preset(cls, quick: bool) -> ClusterBenchSettings:
        if quick:
            return cls(prompts=2, group_size=2, n_turns=2, workers=[2], ranks=[2], batches=1, learner_steps=1)
        return cls()

    def on_model(self, model: str) -> ClusterBenchSettings:
        return dataclasses.replace(self, model=model)

    def on_device(self, device: str) -> ClusterBenchSettings:
        return dataclasses.replace(self, device=device)


def _config(settings: ClusterBenchSettings, model_dir: Path, workers: int = 0, ranks: int = 1):
    from kvstreams.train.config import validate_config

    gpu = settings.device.startswith("cuda")
    return validate_config(
        {
            "model": {"path": str(model_dir), "device": settings.device},
            "rollout": {
                "env": "memory",
                "env_args": {"n_turns": settings.n_turns, "n_facts": 1, "noise_words": 16},
                "strategy": "markovian",
                "prompts_per_step": settings.prompts,
                "group_size": settings.group_size,
                "max_reply_tokens": 32,
            },
            "loss": {"entropy_coef": 0.01},
            "train": {"seed": settings.seed, "backend": "flex" if gpu else "blocksparse"},
            "cluster": {
                "rollout_workers": workers,
                "learner_world_size": ranks,
                "worker_gpus": 1.0 if gpu and workers else 0.0,
                "learner_gpus": 1.0 if gpu else 0.0,  # a rank on CUDA needs its GPU, even alone
            },
        }
    )


def bench_cluster(settings: ClusterBenchSettings, models_dir: str | Path, out_dir: str | Path) -> BenchReport:
    import torch

    from kvstreams.cluster.launch import actor_threads, start_ray

    started = time.perf_counter()
    report = BenchReport("cluster", settings=dict(settings.__dict__))
    model_dir = bench_model(settings.model, models_dir)
    biggest = _config(settings, model_dir, max(settings.workers), max(settings.ranks))
    ray = start_ray(biggest.cluster)
    # the in-process rows get the threads of one worker or rank (1 per reserved CPU): on a tiny model
    # torch's default of one thread per core is slower than one thread, which would flatter the actors
    threads = torch.get_num_threads()
    torch.set_num_threads(actor_threads(biggest.cluster.worker_cpus))
    try:
        with progress_bar(1 + len(settings.workers) + 1 + len(settings.ranks)) as step:
            rollouts = _bench_rollouts(report, settings, model_dir, step)
            learner = _bench_learner(report, settings, model_dir, step)
    finally:
        torch.set_num_threads(threads)
        ray.shutdown()
    report.targets += _targets(rollouts, learner)
    report.seconds = round(time.perf_counter() - started, 1)
    report.plots.append(_plot(rollouts, learner, settings, Path(out_dir) / "cluster.png"))
    return report


def _bench_rollouts(report: BenchReport, settings, model_dir: Path, step) -> list[dict]:
    from kvstreams.cluster.workers import WorkerPool
    from kvstreams.models import load_model
    from kvstreams.train.rollouts import RolloutSource

    table = report.section(
        f"rollouts: {settings.prompts} x {settings.group_size} episodes of `memory` ({settings.n_turns} turns), "
        f"{settings.batches} batches",
        ("where", "start-up s", "batch s", "episodes/s", "tokens/s", "vs in-process", "same tokens"),
        note="batch s: median over batches; start-up: starting the actors and loading the model in each",
    )
    cfg = _config(settings, model_dir)
    model, tokenizer = load_model(model_dir, device=settings.device)
    step("rollouts in-process")
    reference = _time_batches(RolloutSource(model, tokenizer, cfg), settings)
    table.rows.append(_rollout_row("in-process", 0.0, reference, reference))
    for n in settings.workers:
        step(f"rollouts on {n} worker(s)")
        t0 = time.perf_counter()
        pool = WorkerPool(_config(settings, model_dir, workers=n))
        pool.publish(model.state_dict(), 0)
        pool.pids()  # wait until every actor is up
        startup = time.perf_counter() - t0
        try:
            table.rows.append(
                _rollout_row(f"{n} Ray worker(s)", startup, _time_batches(pool, settings), reference)
            )
        finally:
            pool.close()
    return table.rows


def _time_batches(source, settings) -> dict:
    seconds, batches = [], []
    for b in range(settings.batches):
        t0 = time.perf_counter()
        batches.append(source.collect(b))
        seconds.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds), "batches": batches}


def _rollout_row(where: str, startup: float, run: dict, reference: dict) -> dict:
    batch = run["batches"][-1]
    same = all(
        [s.trace.tokens.tolist() for s in a.samples] == [s.trace.tokens.tolist() for s in b.samples]
        for a, b in zip(run["batches"], reference["batches"], strict=True)
    )
    return {
        "where": where,
        "start-up s": round(startup, 1),
        "batch s": round(run["seconds"], 2),
        "episodes/s": len(batch.rewards) / run["seconds"],
        "tokens/s": batch.stats.tokens_forwarded / run["seconds"],
        "vs in-process": reference["seconds"] / run["seconds"],
        "same tokens": same,
    }


def _bench_learner(report: BenchReport, settings, model_dir: Path, step) -> list[dict]:
    import copy

    from kvstreams.cluster.fsdp import LearnerGroup
    from kvstreams.models import load_model
    from kvstreams.train.learner import Learner
    from kvstreams.train.prepare import learner_items
    from kvstreams.train.rollouts import RolloutSource

    cfg = _config(settings, model_dir)
    model, tokenizer = load_model(model_dir, device=settings.device)
    batch = RolloutSource(model, tokenizer, cfg).collect(0)
    items, _ = learner_items(batch, 0, cfg.rollout.group_size, True, 3)
    tokens = sum(len(i.trace) for i in items)
    table = report.section(
        f"learner step: {len(items)} traces, {tokens:,} trace tokens, {cfg.optim.micro_batch_tokens} tokens "
        "per micro-batch",
        (
            "where",
            "start-up s",
            "step s",
            "trace tokens/s",
            "vs in-process",
            "step-1 grad norm",
            "|Δ| grad norm",
        ),
        note="step s: median over timed steps after one warm-up step, every setting from the same weights",
    )
    step("learner in-process")
    learner = Learner(copy.deepcopy(model), cfg)
    reference = _time_steps(learner, items, settings)
    table.rows.append(_learner_row("in-process", 0.0, reference, reference, tokens))
    for n in settings.ranks:
        step(f"learner on {n} FSDP2 rank(s)")
        t0 = time.perf_counter()
        group = LearnerGroup(
            _config(settings, model_dir, ranks=n), Learner(copy.deepcopy(model), cfg), resumed=False
        )
        startup = time.perf_counter() - t0
        try:
            table.rows.append(
                _learner_row(
                    f"{n} FSDP2 rank(s)", startup, _time_steps(group, items, settings), reference, tokens
                )
            )
        finally:
            group.close()
    return table.rows


def _time_steps(learner, items, settings) -> dict:
    first = learner.step(items)  # warm-up; its gradient norm is compared across settings
    seconds = []
    for _ in range(settings.learner_steps):
        t0 = time.perf_counter()
        learner.step(items)
        seconds.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds), "grad_norm": first["grad/norm"]}


def _learner_row(where: str, startup: float, run: dict, reference: dict, tokens: int) -> dict:
    return {
        "where": where,
        "start-up s": round(startup, 1),
        "step s": round(run["seconds"], 3),
        "trace tokens/s": tokens / run["seconds"],
        "vs in-process": reference["seconds"] / run["seconds"],
        "step-1 grad norm": run["grad_norm"],
        "|Δ| grad norm": abs(run["grad_norm"] - reference["grad_norm"]),
    }


def _targets(rollouts: list[dict], learner: list[dict]) -> list[Target]:
    worst = max(r["|Δ| grad norm"] / max(r["step-1 grad norm"], 1e-12) for r in learner)
    return [
        Target(
            "workers sample the in-process episodes",
            "same tokens in every batch",
            f"{sum(r['same tokens'] for r in rollouts)}/{len(rollouts)} settings",
            all(r["same tokens"] for r in rollouts),
        ),
        Target(
            "FSDP2 ranks take the in-process step",
            "relative |Δ| grad norm <= 1e-4",
            f"worst {worst:.1e}",
            worst <= 1e-4,
        ),
    ]


def _plot(rollouts: list[dict], learner: list[dict], settings, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar([r["where"] for r in rollouts], [r["episodes/s"] for r in rollouts], color="tab:blue")
    left.set_title(f"rollouts, {settings.model} on {settings.device}")
    left.set_ylabel("episodes / s (per batch, start-up excluded)")
    right.bar([r["where"] for r in learner], [r["step s"] for r in learner], color="tab:orange")
    right.set_title("learner step")
    right.set_ylabel("seconds per step")
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelsize=8)
    return save_figure(fig, path)

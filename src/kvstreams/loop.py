"""``kvstreams train``: the RL loop, read top to bottom: load -> collect -> learn -> publish -> evaluate
-> checkpoint.

It sits above its parts: ``train/`` (rollouts, learner, loss, corrections, evaluation, checkpoints) and
``cluster/`` (their Ray and FSDP2 scale-out, which imports ``train/``) are both below it, so neither
folder imports the other both ways.

Versions: the starting weights are version 0 and learner step s publishes version s + 1, so the
rollouts trained at step s were sampled by version s when nothing runs ahead. Synchronous mode
collects a batch with the current weights (version s), then trains on it: every token's staleness
is 0. Asynchronous mode collects ahead in the background (:mod:`kvstreams.train.async_rollouts`);
before training, groups whose oldest token is more than ``train.max_off_policy_steps`` versions old
are dropped (prime-rl's bound, ``train/prepare.py``); the rest are corrected by the PPO ratio against
the recorded sampler log-probs (the shadow correction) or the correction's own weights.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstreams.atomic import claim, ensure_writable, holder, release, write_json
from kvstreams.cluster.fsdp import LearnerGroup
from kvstreams.cluster.launch import ray_session
from kvstreams.cluster.workers import WorkerPool
from kvstreams.errors import KVStreamsError
from kvstreams.models import load_model
from kvstreams.progress import training_bar
from kvstreams.train import evaluation
from kvstreams.train.async_rollouts import AsyncRollouts, PublishedWeights
from kvstreams.train.checkpoint import prepare_run, resume_run, save_checkpoint
from kvstreams.train.config import Config
from kvstreams.train.learner import Learner, check_integrity
from kvstreams.train.metrics import MetricsLog, rollout_metrics, run_summary
from kvstreams.train.prepare import learner_items
from kvstreams.train.rollouts import RolloutBatch, RolloutSource, report_failures, single_turn

TRAIN_LOCK = "train.lock"


def train(
    cfg: Config, resume: bool = False, show_progress: bool = True, allow_config_change: bool = False
) -> dict[str, Any]:
    """Run the configured training; returns the summary (also written to ``summary.json``). One
    process at a time per ``train.out_dir`` (a lock file)."""
    out = Path(cfg.train.out_dir)
    ensure_writable(out, "train.out_dir")
    if not claim(out, TRAIN_LOCK):
        raise KVStreamsError(f"{out} is in use by another kvstreams train (pid {holder(out, TRAIN_LOCK)})")
    try:
        with ray_session(cfg.cluster):
            return _train(cfg, resume, show_progress, allow_config_change)
    finally:
        release(out, TRAIN_LOCK)


def _train(cfg: Config, resume: bool, show_progress: bool, allow_config_change: bool) -> dict[str, Any]:
    out = Path(cfg.train.out_dir)
    model, tokenizer, learner, start = _load(cfg, resume, allow_config_change)
    log = MetricsLog(out, tensorboard=cfg.train.tensorboard, keep_until=start if resume else None)
    rollouts = _Rollouts.build(cfg, model, tokenizer, start)
    write_json(out / "config.json", cfg.model_dump())
    first_eval: dict[str, float] = {}
    if start == 0 and cfg.train.eval_every:  # the "before" of every before/after figure
        first_eval = rollouts.evaluate(cfg)
        log.log(0, first_eval)
    last: dict[str, float] = {}
    guard = _Guard()
    try:
        with training_bar(cfg.train.steps, start) if show_progress else nullcontext(None) as bar:
            for step in range(start, cfg.train.steps):
                last = _step(cfg, step, model, learner, rollouts, guard, log)
                if bar is not None:
                    bar(step + 1, last)
    finally:
        rollouts.close()
        if isinstance(learner, LearnerGroup):
            learner.close()
        log.close()
    summary = run_summary(cfg, log.read(), last, first_eval)
    if cfg.train.plots:
        summary["plots"] = [str(p) for p in log.plot()]
    write_json(out / "summary.json", summary)
    return summary


def _step(
    cfg: Config, step: int, model, learner, rollouts: _Rollouts, guard: _Guard, log: MetricsLog
) -> dict[str, float]:
    """One step of the story: collect a batch, learn from it, publish the new weights, evaluate when
    due, log, checkpoint when due; the step's metrics."""
    started = time.perf_counter()
    batch, seconds = rollouts.collect(step)
    metrics = _learn(cfg, learner, batch, step, seconds, guard.reported)
    saving = (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == cfg.train.steps
    learner.gather(optimizer=saving)  # FSDP2 ranks: their weights into `model`
    if rollouts.pool is not None:
        metrics.update(rollouts.pool.metrics())
    # wall-clock of the step without evaluation or checkpointing: what speed-to-reward counts
    metrics["time/step_seconds"] = time.perf_counter() - started
    # stop before a broken model is published, evaluated or saved
    guard.nonfinite_run = guard.nonfinite_run + 1 if metrics["optim/nonfinite_skipped"] else 0
    check_integrity(learner, cfg, step, guard.nonfinite_run)
    rollouts.publish(model, step)
    if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
        metrics.update(rollouts.evaluate(cfg))
    log.log(step + 1, metrics)  # before the checkpoint: a resume drops rows past it, never misses one
    if saving:
        checkpoints = Path(cfg.train.out_dir) / "checkpoints"
        optimizer = (learner.optimizer, learner.scheduler)
        save_checkpoint(checkpoints, step, model, *optimizer, cfg.model_dump(), cfg.train.keep_last)
    return metrics


def _learn(
    cfg: Config, learner: Learner, batch: RolloutBatch, step: int, seconds: float, reported: set[str]
) -> dict[str, float]:
    """One learner update on a batch of rollouts; returns the step's metrics (rollout, off-policy,
    loss and optimiser figures). Environment failures are reported (once each) before the update."""
    metrics = rollout_metrics(batch, seconds)
    if cfg.rollout.curriculum:  # which task this batch was sampled on (0, 1, ...; the last: the target)
        metrics["curriculum/stage"] = float(cfg.rollout.stage_of(step))
    items, off_policy = learner_items(
        batch,
        step,
        cfg.rollout.group_size,
        cfg.loss.normalize_std,
        cfg.train.max_off_policy_steps,
        drop_zero_variance=cfg.train.zero_variance_groups == "drop",
    )
    metrics.update(off_policy)
    report_failures(batch, step, reported)
    metrics.update(learner.step(items))
    return metrics


@dataclass
class _Guard:
    """What the loop remembers across steps to stop early rather than train on garbage."""

    nonfinite_run: int = 0  # consecutive steps whose update was skipped for a non-finite loss or gradient
    reported: set[str] | None = None  # environment errors already printed

    def __post_init__(self) -> None:
        self.reported = set() if self.reported is None else self.reported


def _load(cfg: Config, resume: bool, allow_config_change: bool):
    """The model, tokenizer and learner, restored from the run's newest good checkpoint when resuming;
    returns them with the first step to run."""
    out = Path(cfg.train.out_dir)
    prepare_run(out, resume)
    model, tokenizer = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
    _check_reply_limit(cfg, model)
    reference = None
    if cfg.loss.kl_coef > 0 and cfg.cluster.learner_world_size == 1:  # FSDP2 ranks load their own
        reference = load_model(
            cfg.model.reference or cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device
        )[0]
    torch.manual_seed(cfg.train.seed)
    learner = Learner(model, cfg, reference)
    start = 0
    if resume:
        start = resume_run(out, cfg, model, learner.optimizer, learner.scheduler, allow_config_change)
    if cfg.cluster.learner_world_size > 1:  # the ranks start from what this process loaded
        return model, tokenizer, LearnerGroup(cfg, learner, resumed=resume), start
    return model, tokenizer, learner, start


def _check_reply_limit(cfg: Config, model) -> None:
    """A reply limit beyond the model's positions would fail only at replay, after a step's rollouts:
    refuse it once the model's config is known, before any compute."""
    limit = getattr(model.config, "max_position_embeddings", None)
    r = cfg.rollout
    key, value = (
        ("max_new_tokens", r.max_new_tokens) if single_turn(cfg) else ("max_reply_tokens", r.max_reply_tokens)
    )
    if limit is not None and value >= limit:
        raise KVStreamsError(
            f"rollout.{key} = {value} reaches the model's max_position_embeddings ({limit}): no prompt fits"
        )


@dataclass
class _Rollouts:
    """Where the rollouts come from: this process's model, the rollout workers (``pool``), or a
    background producer running ahead (on a copy of the model, or on the workers)."""

    source: RolloutSource | WorkerPool  # what synchronous training collects with
    evaluator: RolloutSource | WorkerPool  # what evaluation samples with
    weights: PublishedWeights
    pool: WorkerPool | None = None
    producer: AsyncRollouts | None = None

    @classmethod
    def build(cls, cfg: Config, model, tokenizer, start: int) -> _Rollouts:
        """The workers, or in asynchronous mode a copy of the model, get every version of the weights as
        it is published. Evaluation runs where the training rollouts do, except in asynchronous training
        on workers: they are busy sampling ahead with older weights, so it uses the learner's model."""
        local = RolloutSource(model, tokenizer, cfg, version=start)
        pool = None
        if cfg.cluster.rollout_workers:
            pool = WorkerPool(cfg, asynchronous=cfg.train.asynchronous)
            pool.publish(model.state_dict(), start)
        weights = PublishedWeights(pool=pool)
        producer = None
        if cfg.train.asynchronous:
            own = pool or RolloutSource(copy.deepcopy(model), tokenizer, cfg, version=start)
            producer = AsyncRollouts(own, cfg, start, weights)
        source = pool or local
        return cls(source, local if producer is not None else source, weights, pool, producer)

    def collect(self, step: int) -> tuple[RolloutBatch, float]:
        """The batch of ``step`` and the seconds its collection took."""
        if self.producer is not None:  # sampled in the background, at most max_off_policy_steps behind
            return self.producer.get()
        started = time.perf_counter()
        self.source.version = step  # the weights the learner has after `step` updates
        batch = self.source.collect(step)
        return batch, time.perf_counter() - started

    def publish(self, model, step: int) -> None:
        """Hand the weights of version ``step + 1`` to whatever samples apart from the learner's model."""
        if self.producer is not None or self.pool is not None:
            self.weights.publish(model, step + 1)
        if self.producer is not None:
            self.producer.learner_done(step)

    def evaluate(self, cfg: Config) -> dict[str, float]:
        return evaluation.evaluate(self.evaluator, cfg.train.eval_episodes, cfg.train.eval_samples)

    def close(self) -> None:
        for part in (self.producer, self.pool):
            if part is not None:
                part.close()

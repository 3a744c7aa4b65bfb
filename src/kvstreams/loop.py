"""``kvstreams train``: the RL loop (rollouts -> learner -> weights back to the engine).

It sits above its parts: ``train/`` (rollouts, learner, corrections, evaluation, checkpoints) and
``cluster/`` (their Ray and FSDP2 scale-out, which imports ``train/``) are both below it, so neither
folder imports the other both ways.

Versions: the starting weights are version 0 and learner step s publishes version s + 1, so the
rollouts trained at step s were sampled by version s when nothing runs ahead. Synchronous mode
collects a batch with the current weights (version s), then trains on it: every token's staleness
is 0. Asynchronous mode collects in a background thread with its own copy of the model; the
rollouts of step s start once version s - ``train.max_async_level`` is published, and newer weights
reach the copy *between decode steps of running episodes* (``update_weights``), without flushing
their KV caches; every token records the version that sampled it. Before training, groups whose
oldest token is more than ``train.max_off_policy_steps`` versions old are dropped (prime-rl's
bound, ``train/prepare.py``); the rest are corrected by the PPO ratio against the recorded sampler
log-probs (the shadow correction) or the correction's own weights.
"""

from __future__ import annotations

import copy
import json
import queue
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstreams.atomic import claim, ensure_writable, holder, release, write_json
from kvstreams.cluster.fsdp import LearnerGroup
from kvstreams.cluster.launch import ray_session
from kvstreams.cluster.workers import WorkerPool
from kvstreams.errors import KVStreamsError
from kvstreams.models import load_model
from kvstreams.train import evaluation
from kvstreams.train.checkpoint import latest_checkpoint, remove_orphans, resume_latest, save_checkpoint
from kvstreams.train.config import Config
from kvstreams.train.learner import Learner
from kvstreams.train.metrics import MetricsLog
from kvstreams.train.prepare import learner_items
from kvstreams.train.rollouts import RolloutBatch, RolloutSource, WeightsTarget, single_turn

TRAIN_LOCK = "train.lock"
REPREFILL_EQUIVALENT = (
    "N + (N - N0) r / (B - r): N tokens forwarded, N0 before each episode's first compaction"
)


def rollout_metrics(batch: RolloutBatch, seconds: float) -> dict[str, float]:
    s = batch.stats
    sampled = sum(int(x.trace.sampled_mask.sum()) for x in batch.samples)
    episodes = max(1, len(batch.rewards))
    m = {
        "reward/mean": sum(batch.rewards) / episodes,
        "response/length_mean": sampled / episodes,
        "tokens/forwarded": float(s.tokens_forwarded),
        "tokens/reprefilled": float(s.tokens_reprefilled),
        "tokens/trace": float(s.tokens_trace),
        "kv/peak_bytes": float(s.kv_peak_bytes),
        "kv/peak_entries": float(s.kv_peak_entries),
        "kv/saving": sum(x.trace.kv_saving() for x in batch.samples) / max(1, len(batch.samples)),
        "rollout/compactions": float(s.compactions),
        "rollout/observations_truncated": float(s.observations_truncated),
        "rollout/seconds": seconds,
        "tokens/s": s.tokens_forwarded / max(seconds, 1e-9),
        **batch.outcome_means(),
    }
    # What the standard pipeline would have forwarded for the same rollouts, by the closed form in its
    # steady-state use (REPREFILL_EQUIVALENT): the first fill from 0 to B re-prefills nothing, and
    # leaving it out keeps the formula within 8% of counted re-prefills (docs/benchmarks.md).
    if s.compactions and s.retained_mean < s.context_at_compaction_mean:
        new = s.tokens_forwarded - s.tokens_reprefilled
        m["tokens/reprefill_equivalent"] = new + s.tokens_reprefilled_predicted_steady
    return m


@dataclass
class _Weights:
    """The learner's latest weights, published for the rollout thread."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0
    state: dict[str, torch.Tensor] | None = None
    pool: WorkerPool | None = None  # rollout workers get each version as it is published

    def publish(self, model, version: int) -> None:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with self.lock:
            self.state, self.version = state, version
        if self.pool is not None:
            self.pool.publish(state, version)

    def take_newer(self, than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self.lock:
            if self.state is not None and self.version > than:
                return self.version, self.state
        return None


class AsyncRollouts:
    """Collects batches ahead of the learner in a thread: the rollouts of step s start once the weights
    of version s - ``max_async_level`` are published (the learner has finished that many steps)."""

    def __init__(
        self, source: RolloutSource | WorkerPool, cfg: Config, start_step: int, weights: _Weights
    ) -> None:
        self.source = source  # a copy of the model, or the rollout workers
        self.weights = weights
        self.max_async_level = cfg.train.max_async_level
        self.queue: queue.Queue = queue.Queue()
        self.learner_step = start_step  # the newest published version
        self.cond = threading.Condition()
        self.stop = False
        self.thread = threading.Thread(target=self._run, args=(start_step, cfg.train.steps), daemon=True)
        self.thread.start()

    def _refresh(self, _step: int, target: WeightsTarget | None = None) -> None:
        if isinstance(self.source, WorkerPool):
            return  # the workers were handed each version as it was published
        newer = self.weights.take_newer(self.source.version)
        if newer is None:
            return
        version, state = newer
        if target is not None:
            target.update_weights(state, version)  # mid-rollout: the KV cache is kept
        else:
            self.source.model.load_state_dict(state)
        self.source.version = version

    def _run(self, start: int, steps: int) -> None:
        try:
            for step in range(start, steps):
                with self.cond:
                    self.cond.wait_for(
                        lambda s=step: self.stop or self.learner_step >= s - self.max_async_level
                    )
                    if self.stop:
                        return
                self._refresh(step)
                t0 = time.perf_counter()
                batch = self.source.collect(step, on_step=self._refresh)
                self.queue.put((batch, time.perf_counter() - t0))
        except BaseException as err:  # surface the failure to the learner
            self.queue.put(err)

    def get(self) -> tuple[RolloutBatch, float]:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def learner_done(self, step: int) -> None:
        with self.cond:
            self.learner_step = step + 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()


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


def _load(cfg: Config, resume: bool, allow_config_change: bool):
    """The model, tokenizer and learner, restored from the run's newest good checkpoint when resuming;
    returns them with the first step to run."""
    out = Path(cfg.train.out_dir)
    checkpoints = out / "checkpoints"
    for orphan in remove_orphans(checkpoints):
        print(
            f"kvstreams train: removed {orphan.name}, a checkpoint a killed run left unfinished",
            file=sys.stderr,
        )
    if not resume and latest_checkpoint(checkpoints) is not None:
        raise KVStreamsError(
            f"{out} already holds a run; pass --resume to continue it or choose another out_dir"
        )
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
        path, state, skipped = resume_latest(checkpoints, model, learner.optimizer, learner.scheduler)
        for line in skipped:
            print(
                f"kvstreams train: passed over checkpoint {line}; resuming from {path.name}", file=sys.stderr
            )
        start = int(state["step"]) + 1
        if start >= cfg.train.steps:
            raise KVStreamsError(
                f"{out} is finished ({start} of train.steps = {cfg.train.steps} steps done); "
                "raise train.steps to continue it"
            )
        _check_drift(state.get("config", {}), cfg, out, start, allow_config_change)
    if cfg.cluster.learner_world_size > 1:  # the ranks start from what this process loaded
        return model, tokenizer, LearnerGroup(cfg, learner, resumed=resume), start
    return model, tokenizer, learner, start


# Settings a resumed run may change freely: they alter what is logged and kept, not what is optimised.
FREE_TO_CHANGE = (
    "train.steps",
    "train.eval_every",
    "train.eval_episodes",
    "train.eval_samples",
    "train.checkpoint_every",
    "train.keep_last",
    "train.max_nonfinite_steps",
    "train.tensorboard",
    "train.plots",
    "train.out_dir",
    "model.device",
    "sft.",
    "cluster.",  # where the work runs, not what is optimised: resume with another layout
)


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """Dotted keys whose value differs between two config dumps, except :data:`FREE_TO_CHANGE`
    (``train.steps`` only under a constant schedule: it stretches a linear or cosine one)."""
    a, b = _flatten(old), _flatten(new)
    free = FREE_TO_CHANGE
    if b.get("optim.schedule", "constant") != "constant":
        free = tuple(k for k in FREE_TO_CHANGE if k != "train.steps")
    return {
        k: [a.get(k), b.get(k)]
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not k.startswith(free)
    }


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("env_args", "strategy_args", "policy_args"):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _check_drift(old: dict[str, Any], cfg: Config, out: Path, start: int, allowed: bool) -> None:
    """Refuse to resume under a config that changes the optimisation, unless allowed (then recorded)."""
    changes = config_changes(old, cfg.model_dump())
    if not changes:
        return
    listed = ", ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changes.items())
    if not allowed:
        raise KVStreamsError(
            f"the config differs from the one {out} was trained with ({listed}); "
            "pass --allow-config-change to resume under the new one (the change is recorded)"
        )
    with (out / "config_changes.jsonl").open("a") as f:
        f.write(json.dumps({"step": start, "changes": changes}) + "\n")
    print(f"kvstreams train: resuming at step {start} under a changed config ({listed})", file=sys.stderr)


def _train(cfg: Config, resume: bool, show_progress: bool, allow_config_change: bool) -> dict[str, Any]:
    out = Path(cfg.train.out_dir)
    checkpoints = out / "checkpoints"
    model, tokenizer, learner, start = _load(cfg, resume, allow_config_change)
    log = MetricsLog(out, tensorboard=cfg.train.tensorboard, keep_until=start if resume else None)
    pool, source, evaluator, weights, producer = _rollouts(cfg, model, tokenizer, start)
    write_json(out / "config.json", cfg.model_dump())

    def evaluate(step: int) -> dict[str, float]:
        return evaluation.evaluate(evaluator, cfg.train.eval_episodes, cfg.train.eval_samples)

    first_eval: dict[str, float] = {}
    if start == 0 and cfg.train.eval_every:
        first_eval = evaluate(0)
        log.log(0, first_eval)
    progress_ctx = _progress(cfg.train.steps, start) if show_progress else nullcontext(None)
    last: dict[str, float] = {}
    nonfinite_run = 0  # consecutive steps whose update was skipped for a non-finite loss or gradient
    reported: set[str] = set()  # environment errors already printed
    try:
        with progress_ctx as progress:
            for step in range(start, cfg.train.steps):
                t_step = time.perf_counter()
                if producer is not None:  # sampled in the background, at most max_off_policy_steps behind
                    batch, seconds = producer.get()
                else:
                    t0 = time.perf_counter()
                    source.version = step  # the weights the learner has after `step` updates
                    batch = source.collect(step)
                    seconds = time.perf_counter() - t0
                metrics = _learn(cfg, learner, batch, step, seconds, reported)
                saving = (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == cfg.train.steps
                learner.gather(optimizer=saving)  # FSDP2 ranks: their weights into `model`
                if pool is not None:
                    metrics.update(pool.metrics())
                # wall-clock of the step without evaluation or checkpointing: what speed-to-reward counts
                metrics["time/step_seconds"] = time.perf_counter() - t_step
                nonfinite_run = nonfinite_run + 1 if metrics["optim/nonfinite_skipped"] else 0
                _check_integrity(learner, cfg, step, nonfinite_run)
                if producer is not None or pool is not None:
                    weights.publish(model, step + 1)
                if producer is not None:
                    producer.learner_done(step)
                if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
                    metrics.update(evaluate(step + 1))
                log.log(step + 1, metrics)
                last = metrics
                if saving:
                    opt = (learner.optimizer, learner.scheduler)
                    save_checkpoint(checkpoints, step, model, *opt, cfg.model_dump(), cfg.train.keep_last)
                if progress is not None:
                    progress(step + 1, metrics)
    finally:
        for part in (producer, pool, learner if isinstance(learner, LearnerGroup) else None):
            if part is not None:
                part.close()
        log.close()
    summary = _summary(cfg, log.read(), last, first_eval)
    if cfg.train.plots:
        summary["plots"] = [str(p) for p in log.plot()]
    write_json(out / "summary.json", summary)
    return summary


def _rollouts(cfg: Config, model, tokenizer, start: int):
    """Where the rollouts come from: (the rollout workers or None, what the trainer collects with,
    what it evaluates with, the published weights, the asynchronous producer or None). The workers,
    or in asynchronous mode a copy of the model, get every version of the weights as it is published.
    Evaluation runs where the training rollouts do, except in asynchronous training on workers: they
    are busy sampling ahead with older weights, so evaluation uses the learner's model here."""
    local = RolloutSource(model, tokenizer, cfg, version=start)
    pool = None
    if cfg.cluster.rollout_workers:
        pool = WorkerPool(cfg, asynchronous=cfg.train.asynchronous)
        pool.publish(model.state_dict(), start)
    source = pool or local
    weights = _Weights(pool=pool)
    producer = None
    if cfg.train.asynchronous:
        own = pool or RolloutSource(copy.deepcopy(model), tokenizer, cfg, version=start)
        producer = AsyncRollouts(own, cfg, start, weights)
    evaluator = local if producer is not None else source
    return pool, source, evaluator, weights, producer


def _learn(
    cfg: Config, learner: Learner, batch: RolloutBatch, step: int, seconds: float, reported: set[str]
) -> dict[str, float]:
    """One learner update on a batch of rollouts; returns the step's metrics (rollout, off-policy,
    loss and optimiser figures). Environment failures are reported (once each) before the update."""
    metrics = rollout_metrics(batch, seconds)
    items, off_policy = learner_items(
        batch,
        step,
        cfg.rollout.group_size,
        cfg.loss.normalize_std,
        cfg.train.max_off_policy_steps,
        drop_zero_variance=cfg.train.zero_variance_groups == "drop",
    )
    metrics.update(off_policy)
    _report_failures(batch, step, reported)
    metrics.update(learner.step(items))
    return metrics


def _summary(
    cfg: Config, rows: list[dict[str, Any]], last: dict[str, float], first_eval: dict[str, float]
) -> dict[str, Any]:
    """``summary.json``: evaluation before and after, the last step's metrics, mismatch and tokens."""
    evals = [r for r in rows if "eval/reward_mean" in r]
    return {
        "steps": cfg.train.steps,
        "eval_before": evals[0] if evals else None,
        "eval_after": evals[-1] if len(evals) > 1 else None,
        "final": last,
        "first_eval": first_eval,
        "mismatch_k3_kl_mean": _mean(rows, "mismatch/k3_kl"),
        "mismatch_abs_logprob_diff_max": max(
            (r["mismatch/abs_logprob_diff_max"] for r in rows if "mismatch/abs_logprob_diff_max" in r),
            default=None,
        ),
        "tokens_forwarded": sum(r.get("tokens/forwarded", 0) for r in rows),
        "tokens_reprefill_equivalent": sum(
            r.get("tokens/reprefill_equivalent", r.get("tokens/forwarded", 0)) for r in rows
        ),
        "tokens_reprefill_equivalent_formula": REPREFILL_EQUIVALENT,
    }


def _report_failures(batch: RolloutBatch, step: int, reported: set[str]) -> None:
    """Episodes whose environment raised are dropped from the batch (``learner_items``); each distinct
    error is printed once, with the seed it first came from; a step where most episodes fail stops."""
    errors = [e for e in batch.errors if e]
    for error in errors:
        kind = error.split(": ", 1)[-1]
        if kind not in reported:
            reported.add(kind)
            print(
                f"kvstreams train: step {step + 1}: episode dropped, environment failed ({error})",
                file=sys.stderr,
            )
    if errors and len(errors) > len(batch.rewards) / 2:
        raise KVStreamsError(
            f"step {step + 1}: {len(errors)} of {len(batch.rewards)} episodes failed in their environment; "
            f"first: {errors[0]}"
        )


def _check_integrity(learner: Learner, cfg: Config, step: int, nonfinite_run: int) -> None:
    """Stop before a broken model is used or checkpointed: weights that are no longer finite, or
    ``train.max_nonfinite_steps`` updates in a row skipped for a non-finite loss or gradient."""
    last_saved = "no checkpoint was written" if step == 0 else "earlier checkpoints are intact"
    if not learner.weights_finite():
        raise KVStreamsError(
            f"step {step + 1}: the update left non-finite weights (optim.lr = {cfg.optim.lr:g}); "
            f"nothing from this step is saved and {last_saved}"
        )
    if nonfinite_run >= cfg.train.max_nonfinite_steps:
        raise KVStreamsError(
            f"step {step + 1}: {nonfinite_run} updates in a row skipped for a non-finite loss or gradient "
            f"(train.max_nonfinite_steps = {cfg.train.max_nonfinite_steps}); check optim.lr and the loss "
            f"coefficients; {last_saved}"
        )


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


@contextmanager
def _progress(total: int, start: int):
    """The training bar, with the live figures; yields ``update(step, metrics)``."""
    from kvstreams.progress import progress

    with progress("train", total, start, transient=False, info=True) as bar:

        def update(step: int, m: dict[str, float]) -> None:
            info = (
                f"reward {m.get('reward/mean', 0):.3f}  mismatch k3 {m.get('mismatch/k3_kl', 0):.1e}  "
                f"{m.get('tokens/s', 0):.0f} tok/s"
            )
            bar.update(completed=step, info=info)

        yield update

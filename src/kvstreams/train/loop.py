"""``kvstreams train``: the RL loop (rollouts -> learner -> weights back to the engine).

Synchronous mode collects a batch with the current weights, then trains on it. Asynchronous mode
collects in a background thread with its own copy of the model, at most ``max_off_policy_steps``
batches ahead of the learner; new weights reach that copy *between decode steps of running
episodes* (``StreamSession.update_weights``), without flushing their KV caches, and every token
records the version that sampled it. Stale tokens are corrected by using the recorded sampler
log-probs as the behaviour policy in the PPO ratio.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstreams.atomic import write_json
from kvstreams.engine.stream import StreamSession
from kvstreams.episodes import reprefill_closed_form
from kvstreams.errors import KVStreamsError
from kvstreams.models import load_model
from kvstreams.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from kvstreams.train.config import Config
from kvstreams.train.learner import Learner
from kvstreams.train.metrics import MetricsLog
from kvstreams.train.rollouts import RolloutBatch, RolloutSource


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
        "rollout/compactions": float(s.compactions),
        "rollout/seconds": seconds,
        "tokens/s": s.tokens_forwarded / max(seconds, 1e-9),
    }
    # what the standard pipeline would have forwarded for the same rollouts: N + N * r / (B - r)
    if s.compactions and s.retained_mean < s.context_at_compaction_mean:
        new = s.tokens_forwarded - s.tokens_reprefilled
        m["tokens/reprefill_equivalent"] = new + reprefill_closed_form(
            new, s.retained_mean, s.context_at_compaction_mean
        )
    versions = [x.trace.policy_version for x in batch.samples if x.trace.policy_version is not None]
    if versions:
        sampled_versions = torch.cat(
            [v[x.trace.sampled_mask] for v, x in zip(versions, batch.samples, strict=True)]
        )
        if sampled_versions.numel():
            m["rollout/version_min"] = float(sampled_versions.min())
            m["rollout/version_max"] = float(sampled_versions.max())
    return m


@dataclass
class _Weights:
    """The learner's latest weights, published for the rollout thread."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0
    state: dict[str, torch.Tensor] | None = None

    def publish(self, model, version: int) -> None:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with self.lock:
            self.state, self.version = state, version

    def take_newer(self, than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self.lock:
            if self.state is not None and self.version > than:
                return self.version, self.state
        return None


class AsyncRollouts:
    """Collects batches ahead of the learner in a thread, never more than ``max_lag`` steps ahead."""

    def __init__(self, model, tokenizer, cfg: Config, start_step: int, weights: _Weights) -> None:
        self.model = copy.deepcopy(model)
        self.source = RolloutSource(self.model, tokenizer, cfg)
        self.weights = weights
        self.max_lag = cfg.train.max_off_policy_steps
        self.queue: queue.Queue = queue.Queue()
        self.learner_step = start_step
        self.cond = threading.Condition()
        self.stop = False
        self.version = start_step
        self.thread = threading.Thread(target=self._run, args=(start_step, cfg.train.steps), daemon=True)
        self.thread.start()

    def _refresh(self, _step: int, session: StreamSession | None = None) -> None:
        newer = self.weights.take_newer(self.version)
        if newer is None:
            return
        version, state = newer
        if session is not None:
            session.update_weights(state, version)  # mid-episode: the KV cache is kept
        else:
            self.model.load_state_dict(state)
        self.version = version

    def _run(self, start: int, steps: int) -> None:
        try:
            for step in range(start, steps):
                with self.cond:
                    self.cond.wait_for(lambda s=step: self.stop or s - self.learner_step < self.max_lag)
                    if self.stop:
                        return
                self._refresh(step)
                t0 = time.perf_counter()
                batch = self.source.collect(step, on_step=self._refresh)
                batch.version = self.version
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


def train(cfg: Config, resume: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Run the configured training; returns the summary (also written to ``summary.json``)."""
    out = Path(cfg.train.out_dir)
    checkpoints = out / "checkpoints"
    checkpoint = latest_checkpoint(checkpoints) if resume else None
    if resume and checkpoint is None:
        raise KVStreamsError(f"nothing to resume: no checkpoint under {checkpoints}")
    if not resume and latest_checkpoint(checkpoints) is not None:
        raise KVStreamsError(
            f"{out} already holds a run; pass --resume to continue it or choose another out_dir"
        )
    model, tokenizer = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
    reference = None
    if cfg.loss.kl_coef > 0:
        reference = load_model(
            cfg.model.reference or cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device
        )[0]
    torch.manual_seed(cfg.train.seed)
    learner = Learner(model, cfg, reference)
    start = 0
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, learner.optimizer, learner.scheduler)
        start = int(state["step"]) + 1
    log = MetricsLog(
        out, tensorboard=cfg.train.tensorboard, keep_until=start if checkpoint is not None else None
    )
    source = RolloutSource(model, tokenizer, cfg)
    write_json(out / "config.json", cfg.model_dump())

    def evaluate(step: int) -> dict[str, float]:
        n = cfg.train.eval_episodes
        return {
            "eval/reward_mean": source.evaluate(n, greedy=False),
            "eval/reward_greedy": source.evaluate(n, greedy=True),
        }

    first_eval: dict[str, float] = {}
    if start == 0 and cfg.train.eval_every:
        first_eval = evaluate(0)
        log.log(0, first_eval)
    weights = _Weights()
    producer = AsyncRollouts(model, tokenizer, cfg, start, weights) if cfg.train.asynchronous else None
    progress_ctx = _progress(cfg.train.steps, start) if show_progress else nullcontext(None)
    last: dict[str, float] = {}
    try:
        with progress_ctx as progress:
            for step in range(start, cfg.train.steps):
                if producer is not None:
                    batch, seconds = producer.get()
                else:
                    t0 = time.perf_counter()
                    batch = source.collect(step)
                    seconds = time.perf_counter() - t0
                metrics = rollout_metrics(batch, seconds)
                metrics.update(learner.step(batch))
                metrics["rollout/staleness_max"] = float(step - metrics.get("rollout/version_min", step))
                if producer is not None:
                    weights.publish(model, step + 1)
                    producer.learner_done(step)
                if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
                    metrics.update(evaluate(step + 1))
                log.log(step + 1, metrics)
                last = metrics
                if (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == cfg.train.steps:
                    save_checkpoint(
                        checkpoints,
                        step,
                        model,
                        learner.optimizer,
                        learner.scheduler,
                        cfg.model_dump(),
                        cfg.train.keep_last,
                    )
                if progress is not None:
                    progress(step + 1, metrics)
    finally:
        if producer is not None:
            producer.close()
        log.close()
    rows = log.read()
    evals = [r for r in rows if "eval/reward_mean" in r]
    summary = {
        "steps": cfg.train.steps,
        "eval_before": evals[0] if evals else None,
        "eval_after": evals[-1] if len(evals) > 1 else None,
        "final": last,
        "first_eval": first_eval,
        "mismatch_kl_mean": _mean(rows, "mismatch/kl"),
        "tokens_forwarded": sum(r.get("tokens/forwarded", 0) for r in rows),
        "tokens_reprefill_equivalent": sum(
            r.get("tokens/reprefill_equivalent", r.get("tokens/forwarded", 0)) for r in rows
        ),
    }
    if cfg.train.plots:
        summary["plots"] = [str(p) for p in log.plot()]
    write_json(out / "summary.json", summary)
    return summary


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


class _progress:
    """A rich progress bar with the live figures."""

    def __init__(self, total: int, start: int) -> None:
        self.total, self.start = total, start

    def __enter__(self):
        import sys

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            disable=not sys.stderr.isatty(),
        )
        self.bar.__enter__()
        self.task = self.bar.add_task("train", total=self.total, completed=self.start, info="")

        def update(step: int, m: dict[str, float]) -> None:
            info = (
                f"reward {m.get('reward/mean', 0):.3f}  mismatch KL {m.get('mismatch/kl', 0):.1e}  "
                f"{m.get('tokens/s', 0):.0f} tok/s"
            )
            self.bar.update(self.task, completed=step, info=info)

        return update

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

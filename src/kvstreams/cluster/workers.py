"""Rollout workers: Ray actors, each an engine replica with its own environments.

The trainer asks the :class:`WorkerPool` for the batch of a step exactly as it asks a local
:class:`~kvstreams.train.rollouts.RolloutSource`: the pool cuts the step's plan (seeds and GRPO groups,
:func:`~kvstreams.train.rollouts.training_plan`) into contiguous shards of whole groups, one per worker,
and puts the shards' batches back together in plan order. An episode's tokens depend on its seeds
alone, so the batch is the same whatever the number of workers (sampler log-probs agree to float
rounding: a row's matmuls run beside different rows).

Weights: each learner update is put once in the object store (:meth:`WorkerPool.publish`) and handed
to every worker. A worker takes new weights at the start of a shard, and, in asynchronous training,
between two decode steps of running episodes (``update_weights``: their KV caches are kept); every
token records the version that sampled it.

A worker that dies (its process killed, its node lost) is replaced by a fresh actor, which reruns the
shard, at most ``cluster.max_worker_restarts`` times in a run; after that the shard's episodes come
back as failed episodes (``worker died``), which the learner drops and the metrics count.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from kvstreams.cluster.launch import actor_threads, start_ray
from kvstreams.cluster.wire import (
    batch_from_wire,
    batch_to_wire,
    merge_batches,
    plan_from_wire,
    plan_to_wire,
    state_from_bytes,
    state_to_bytes,
)
from kvstreams.cost import RolloutCost
from kvstreams.errors import KVStreamsError
from kvstreams.train.config import Config, validate_config
from kvstreams.train.rollouts import EpisodePlan, RolloutBatch, training_plan


class RolloutWorker:
    """One engine replica (run as a Ray actor with ``max_concurrency=2``, so that new weights can
    arrive while a shard is decoding)."""

    def __init__(self, config: dict[str, Any], threads: int) -> None:
        from kvstreams.models import load_model
        from kvstreams.train.rollouts import RolloutSource

        torch.set_num_threads(threads)
        cfg = validate_config(config)
        model, tokenizer = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
        self.source = RolloutSource(model, tokenizer, cfg)
        self.lock = threading.Lock()
        self.pending: tuple[int, bytes] | None = None
        self.loaded = False  # the model still holds the weights read from disk

    def pid(self) -> int:
        return os.getpid()

    def set_weights(self, data: bytes, version: int) -> None:
        """Newer weights, taken at the next decode step of a running shard (or the next shard)."""
        with self.lock:
            newest = self.pending[0] if self.pending is not None else self.source.version
            if version > newest or (self.pending is None and not self.loaded):
                self.pending = (version, data)

    def _take(self, _n: int = 0, target=None) -> None:
        with self.lock:
            pending, self.pending = self.pending, None
        if pending is None:
            return
        version, data = pending
        state = state_from_bytes(data)
        if target is not None:
            target.update_weights(state, version)  # mid-rollout: the running episodes' KV caches stay
        else:
            self.source.model.load_state_dict(state, strict=True)
        self.source.version, self.loaded = version, True

    def run(
        self, plan: dict[str, Any], weights: bytes, version: int, mid_rollout_updates: bool
    ) -> dict[str, Any]:
        """The episodes of ``plan``, starting from ``weights`` (or newer ones received meanwhile); the
        batch as wire data. The weights come with the call: a threaded actor may run a
        ``set_weights`` sent before this call after it."""
        self.set_weights(weights, version)
        self._take()
        on_step = self._take if mid_rollout_updates else None
        return batch_to_wire(self.source.run(plan_from_wire(plan), on_step=on_step))


class WorkerPool:
    """``cluster.rollout_workers`` rollout workers behind the interface of a ``RolloutSource``
    (``collect``, ``run``, ``version``)."""

    def __init__(self, cfg: Config, asynchronous: bool = False) -> None:
        self.cfg = cfg
        self.ray = start_ray(cfg.cluster)
        c = cfg.cluster
        self.actor = self.ray.remote(RolloutWorker).options(
            num_cpus=c.worker_cpus, num_gpus=c.worker_gpus, max_concurrency=2
        )
        self.asynchronous = asynchronous
        self.version = 0
        self.weights: tuple[int, Any] | None = None  # (version, object ref of the safetensors blob)
        self.restarts = 0
        self.episodes_dropped = 0
        self.workers = [self._spawn() for _ in range(c.rollout_workers)]

    def _spawn(self):
        return self.actor.remote(self.cfg.model_dump(), actor_threads(self.cfg.cluster.worker_cpus))

    def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Put version ``version`` of the weights in the object store once and hand it to every worker
        (a worker busy with a shard takes it between decode steps when training asynchronously)."""
        self.weights = (version, self.ray.put(state_to_bytes(state)))
        for worker in self.workers:
            worker.set_weights.remote(self.weights[1], version)
        self.version = version

    def collect(self, step: int, on_step=None, progress=None) -> RolloutBatch:
        """The rollouts of training step ``step``, sharded by GRPO group across the workers."""
        del on_step, progress  # the workers take new weights themselves; no per-step callback
        return self.run(training_plan(self.cfg, step), mid_rollout_updates=self.asynchronous)

    def run(self, plan: EpisodePlan, mid_rollout_updates: bool = False) -> RolloutBatch:
        shards = shard_plan(plan, len(self.workers))
        if self.weights is None:
            raise KVStreamsError("publish the weights before the rollout workers run (WorkerPool.publish)")
        refs = {i: self._submit(i, s, mid_rollout_updates) for i, s in shards}
        parts = [self._result(i, shard, refs[i], mid_rollout_updates) for i, shard in shards]
        return merge_batches(parts)

    def _submit(self, i: int, shard: EpisodePlan, mid_rollout_updates: bool):
        version, weights = self.weights
        return self.workers[i].run.remote(plan_to_wire(shard), weights, version, mid_rollout_updates)

    def _result(self, i: int, shard: EpisodePlan, ref, mid_rollout_updates: bool) -> RolloutBatch:
        """Worker ``i``'s batch; a dead worker is replaced and the shard rerun, or dropped."""
        from ray.exceptions import RayActorError

        while True:
            try:
                return batch_from_wire(self.ray.get(ref), where=f"rollout worker {i}")
            except RayActorError as err:
                if self.restarts >= self.cfg.cluster.max_worker_restarts:
                    self.workers[i] = self._spawn()  # the next batch gets a live worker
                    self.episodes_dropped += len(shard)
                    return failed_batch(shard, f"rollout worker {i} died ({type(err).__name__})")
                self.restarts += 1
                self.workers[i] = self._spawn()
                ref = self._submit(i, shard, mid_rollout_updates)

    def metrics(self) -> dict[str, float]:
        return {
            "cluster/worker_restarts": float(self.restarts),
            "cluster/episodes_dropped": float(self.episodes_dropped),
        }

    def pids(self) -> list[int]:
        return self.ray.get([w.pid.remote() for w in self.workers])

    def close(self) -> None:
        for worker in self.workers:
            self.ray.kill(worker)
        self.workers = []


def shard_plan(plan: EpisodePlan, n: int) -> list[tuple[int, EpisodePlan]]:
    """Contiguous shards of whole GRPO groups, as even as the groups allow, for up to ``n`` workers:
    (worker index, shard) for each worker that gets episodes."""
    starts = [i for i, g in enumerate(plan.groups) if i == 0 or g != plan.groups[i - 1]]
    cuts = [starts[len(starts) * k // n] for k in range(n)] + [len(plan)]
    return [(k, plan.shard(cuts[k], cuts[k + 1])) for k in range(n) if cuts[k] < cuts[k + 1]]


def failed_batch(plan: EpisodePlan, error: str) -> RolloutBatch:
    """The episodes of ``plan`` as failed (no samples, reward 0, ``error``): dropped by the learner."""
    n = len(plan)
    return RolloutBatch(
        [], [0.0] * n, RolloutCost(episodes=n), errors=[f"seed {s}: {error}" for s in plan.env_seeds]
    )

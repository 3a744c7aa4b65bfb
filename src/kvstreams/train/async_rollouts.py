"""Rollouts ahead of the learner: a background producer and the weights it samples with.

Asynchronous mode collects in a thread with its own copy of the model (or on the rollout workers);
the rollouts of step s start once version s - ``train.max_async_level`` is published, and newer
weights reach the copy *between decode steps of running episodes* (``update_weights``), without
flushing their KV caches; every token records the version that sampled it.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstreams.train.config import Config
from kvstreams.train.rollouts import RolloutBatch, RolloutSource, WeightsTarget


@dataclass
class PublishedWeights:
    """The learner's latest weights, published for the rollout thread."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0
    state: dict[str, torch.Tensor] | None = None
    pool: Any = None  # rollout workers get each version as it is published

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

    def __init__(self, source: Any, cfg: Config, start_step: int, weights: PublishedWeights) -> None:
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
        if not isinstance(self.source, RolloutSource):
            return  # rollout workers were handed each version as it was published
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

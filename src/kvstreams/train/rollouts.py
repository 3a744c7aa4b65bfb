"""Rollout batches for the learner: K episodes per prompt (a GRPO group), from the sampler.

Every batch goes through :func:`kvstreams.sampler.sample_episodes` with the config's
:class:`~kvstreams.sampler.SamplerSpec`: multi-turn environments as episodes (compaction in
``stream``, ``reprefill`` or ``full`` mode, a KV compression ``policy`` and ``recall`` inside them),
single-turn ones (``gsm8k``, ``recall``, ``bandit``) as one batch of prompts. Seeds are a function of
(run seed, step), so a resumed run replays exactly the rollouts it would have made.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvstreams.chat import ChatFormat
from kvstreams.cost import RolloutCost
from kvstreams.engine import SamplingParams
from kvstreams.envs import is_single_turn, make_env
from kvstreams.errors import KVStreamsError
from kvstreams.sampler import SamplerSpec, sample_episodes
from kvstreams.trace import Trace
from kvstreams.train.config import Config


class WeightsTarget(Protocol):
    """What holds the sampling weights mid-rollout (the running :class:`StreamSession`, single-turn
    or multi-turn): new weights load between decode steps, the KV cache is kept."""

    def update_weights(self, state_dict: dict, version: int) -> None: ...


@dataclass
class Sample:
    """One trainable trace; an episode in re-prefill mode gives several, sharing its reward."""

    trace: Trace
    group: int
    episode: int
    reward: float


@dataclass
class RolloutBatch:
    samples: list[Sample]
    rewards: list[float]  # per episode, groups contiguous
    stats: RolloutCost
    errors: list[str | None] = field(default_factory=list)  # per episode: why its environment failed
    # per episode: the numbers its environment reported besides the reward (``StepResult.info``)
    outcomes: list[dict[str, float]] = field(default_factory=list)

    def failed(self) -> list[bool]:
        """Per episode: its environment raised (the episode is not trained on)."""
        return [bool(e) for e in self.errors] if self.errors else [False] * len(self.rewards)

    def outcome_means(self, prefix: str = "env/") -> dict[str, float]:
        """Each outcome the environment reported, averaged over the episodes that did not fail and
        report it (e.g. ``env/carried``, the memory task's share of states holding the fact)."""
        failed = self.failed()
        values: dict[str, list[float]] = {}
        for outcome, bad in zip(self.outcomes, failed, strict=False):
            for key, value in [] if bad else outcome.items():
                values.setdefault(key, []).append(value)
        return {f"{prefix}{k}": sum(v) / len(v) for k, v in sorted(values.items())}


def numeric_outcomes(info: dict) -> dict[str, float]:
    """The numbers of an episode's info (bools as 0/1): what :meth:`RolloutBatch.outcome_means` logs."""
    return {
        str(k): float(v) for k, v in info.items() if isinstance(v, int | float) and math.isfinite(float(v))
    }


@dataclass(frozen=True)
class EpisodePlan:
    """The episodes of one batch, in order: each one's environment seed, sampling seed and GRPO group.
    A plan is all a rollout worker needs to reproduce its share of a batch (:meth:`shard`)."""

    env_seeds: list[int]
    sample_seeds: list[int]
    groups: list[int]
    greedy: bool = False
    mode: str = "stream"
    held_out: bool = False
    step: int | None = None  # the training step (its curriculum stage's task); None: an evaluation

    def __len__(self) -> int:
        return len(self.env_seeds)

    def shard(self, lo: int, hi: int) -> EpisodePlan:
        """Episodes ``lo:hi`` of this plan (same seeds, same groups)."""
        return replace(
            self,
            env_seeds=self.env_seeds[lo:hi],
            sample_seeds=self.sample_seeds[lo:hi],
            groups=self.groups[lo:hi],
        )


def training_plan(cfg: Config, step: int) -> EpisodePlan:
    """The rollouts of training step ``step``: ``prompts_per_step`` tasks x ``group_size`` episodes.
    Seeds are a function of (run seed, step) alone, whoever runs them."""
    r = cfg.rollout
    base = cfg.train.seed * 1_000 + step * r.prompts_per_step  # training env seeds stay < eval_seed
    env_seeds = [base + p for p in range(r.prompts_per_step) for _ in range(r.group_size)]
    sample_seeds = [cfg.train.seed * 7_919 + step * 100_003 + i for i in range(len(env_seeds))]
    groups = [p for p in range(r.prompts_per_step) for _ in range(r.group_size)]
    return EpisodePlan(env_seeds, sample_seeds, groups, mode=r.mode, step=step)


def evaluation_plan(cfg: Config, n: int, greedy: bool, samples: int = 1) -> EpisodePlan:
    """Episodes on ``n`` held-out tasks, ``samples`` each (contiguous, one group per task): seeds from
    ``train.eval_seed`` on, in the environment's held-out split (GSM8K's test split); never used for
    training. A task's first sample uses the task's seed as sampling seed, so ``samples = 1`` draws what
    earlier versions drew. Each run is evaluated in its own mode: a re-prefill run in re-prefill mode
    (it was trained on reset positions and on KVs recomputed without the deleted span; served in
    stream mode it would be a different policy). Before 2026-12-07 re-prefill runs were evaluated in
    stream mode: docs/results.md sections 3, 3b say which of their figures that changes."""
    seeds = [cfg.train.eval_seed + i for i in range(n)]
    env_seeds = [s for s in seeds for _ in range(samples)]
    sample_seeds = [s + j * 1_000_003 for s in seeds for j in range(samples)]
    groups = [i for i in range(n) for _ in range(samples)]
    return EpisodePlan(env_seeds, sample_seeds, groups, greedy=greedy, mode=cfg.rollout.mode, held_out=True)


def single_turn(cfg: Config) -> bool:
    """One prompt, one reply (the single-turn engine); a multi-turn environment runs episodes, with its
    policy, if any, compressing inside them."""
    return is_single_turn(cfg.rollout.env)


class RolloutSource:
    """Makes rollout and evaluation batches with a given model (the learner's, or a rollout copy).

    ``version`` is the weights version the model holds (the learner step whose update produced them);
    every sampled token records it, or the newer one a mid-episode weight update brings.
    """

    def __init__(self, model, tokenizer, cfg: Config, version: int = 0) -> None:
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.chat = ChatFormat(tokenizer)
        self.version = version

    def _sampling(self, seed: int, greedy: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=0.0 if greedy else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=seed,
        )

    def collect(
        self,
        step: int,
        on_step: Callable[[int, WeightsTarget], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> RolloutBatch:
        """The rollouts of training step ``step`` (:func:`training_plan`). ``on_step(n, target)`` runs
        after every decode step; it may call ``target.update_weights``."""
        return self.run(training_plan(self.cfg, step), on_step=on_step, progress=progress)

    def run(
        self,
        plan: EpisodePlan,
        on_step: Callable[[int, WeightsTarget], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> RolloutBatch:
        """The episodes of ``plan``, in its order, on its step's task (a curriculum stage's, or the
        target)."""
        r = self.cfg.rollout.at_step(plan.step)
        envs = [make_env(r.env, **r.env_args) for _ in plan.env_seeds]
        if plan.held_out:
            envs = [env.held_out() for env in envs]
        results, stats = sample_episodes(
            self.model,
            self.tokenizer,
            SamplerSpec.from_rollout(r, plan.mode),
            envs,
            plan.env_seeds,
            self._sampling(0, plan.greedy),
            plan.sample_seeds,
            weights_version=self.version,
            on_step=on_step,
            progress=progress,
        )
        samples = [
            Sample(t, plan.groups[res.episode], res.episode, res.reward)
            for res in results
            for t in res.traces
        ]
        errors = [res.error for res in results]
        outcomes = [numeric_outcomes(res.info) for res in results]
        return RolloutBatch(samples, [res.reward for res in results], stats, errors=errors, outcomes=outcomes)


def report_failures(batch: RolloutBatch, step: int, reported: set[str]) -> None:
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

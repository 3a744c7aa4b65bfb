"""Held-out evaluation that can see a gain: pass@1 and pass@k with intervals, and greedy.

``train.eval_episodes`` held-out tasks (seeds from ``train.eval_seed``), each sampled
``train.eval_samples`` times at the training temperature, and once greedily. What is reported:

- ``eval/reward_mean``: the mean reward over every sample (with partial credit, the expected reward
  of one sampled episode; with 0/1 rewards it is pass@1);
- ``eval/pass@1``, ``eval/pass@k`` (k = ``eval_samples``): a task is solved by an episode whose reward
  is 1 (full credit); pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language
  Models Trained on Code", Sec. 2.1), 1 - C(n - c, k) / C(n, k) per task with n samples and c solved,
  averaged over tasks (with k = n it is the share of tasks solved at least once);
- ``eval/reward_greedy``: the mean reward of the greedy episodes;
- ``*_ci``: the half-width of each figure's 95% interval over tasks (Student's t on the per-task
  values: the samples of one task are not independent of each other, the tasks are).

Why: with 64 held-out episodes at p ~ 0.66 one eval's interval is about +-0.12, wider than the
effects RL had shown; 256 episodes (64 tasks x 4, or 256 x 1) bring it to about +-0.06.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Protocol

from kvstreams.errors import KVStreamsError
from kvstreams.stats import mean_interval
from kvstreams.train.rollouts import EpisodePlan, RolloutBatch, evaluation_plan


class EpisodeSource(Protocol):
    """What runs episodes: a :class:`~kvstreams.train.rollouts.RolloutSource` or the rollout workers."""

    cfg: object

    def run(self, plan: EpisodePlan) -> RolloutBatch: ...


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from ``n`` samples of which ``c`` solved it (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _with_interval(metrics: dict[str, float], key: str, per_task: Sequence[float]) -> None:
    iv = mean_interval(per_task)
    metrics[key] = iv.mean
    if iv.half_width is not None:
        metrics[f"{key}_ci"] = iv.half_width


def summarise(sampled: Sequence[Sequence[float]], greedy: Sequence[float] | None) -> dict[str, float]:
    """The figures above from rewards: ``sampled`` [tasks][samples], ``greedy`` [tasks] or None."""
    n = len(sampled[0])
    solved = [sum(r >= 1.0 for r in task) for task in sampled]
    m: dict[str, float] = {}
    _with_interval(m, "eval/reward_mean", [sum(task) / n for task in sampled])
    _with_interval(m, "eval/pass@1", [pass_at_k(n, c, 1) for c in solved])
    if n > 1:
        _with_interval(m, f"eval/pass@{n}", [pass_at_k(n, c, n) for c in solved])
    if greedy is not None:
        _with_interval(m, "eval/reward_greedy", list(greedy))
    m["eval/tasks"] = float(len(sampled))
    m["eval/samples_per_task"] = float(n)
    return m


def evaluate(source: EpisodeSource, tasks: int, samples: int = 1, greedy: bool = True) -> dict[str, float]:
    """Run ``tasks`` held-out tasks ``samples`` times each (and once greedily) and summarise.

    An episode whose environment failed is not a reward of 0: a task with a failed sample is left
    out of the sampled figures (pass@k needs all its samples), a failed greedy episode out of the
    greedy one; ``eval/failed_episodes`` counts them and one line says so. When no task is left the
    evaluation is an error, not a figure."""
    batch = source.run(evaluation_plan(source.cfg, tasks, greedy=False, samples=samples))
    failed = batch.failed()
    sampled = [
        batch.rewards[t * samples : (t + 1) * samples]
        for t in range(tasks)
        if not any(failed[t * samples : (t + 1) * samples])
    ]
    errors = [e for e in batch.errors if e]
    greedy_rewards = None
    if greedy:
        greedy_batch = source.run(evaluation_plan(source.cfg, tasks, greedy=True))
        greedy_rewards = [
            r for r, f in zip(greedy_batch.rewards, greedy_batch.failed(), strict=True) if not f
        ]
        errors += [e for e in greedy_batch.errors if e]
    episodes = tasks * samples + (tasks if greedy else 0)
    if errors:
        print(
            f"kvstreams: evaluation: {len(errors)} of {episodes} episodes failed in their environment and "
            f"are left out (first: {errors[0]})",
            file=sys.stderr,
            flush=True,
        )
    if not sampled:
        raise KVStreamsError(
            f"every evaluation task had an episode whose environment failed; first: {errors[0]}"
        )
    m = summarise(sampled, greedy_rewards or None)
    m.update(batch.outcome_means(prefix="eval/env/"))  # of the sampled episodes
    m.update(kv_figures(batch, prefix="eval/"))
    m["eval/failed_episodes"] = float(len(errors))
    return m


def kv_figures(batch: RolloutBatch, prefix: str) -> dict[str, float]:
    """What the sampled episodes held and fed: ``kv/visible_max_mean``, the mean over episodes of the
    most entries any of its queries saw (the largest over layers and KV heads, over its segments);
    ``tokens_forwarded_per_episode``; ``recalls_per_episode`` (deleted units brought back)."""
    most: dict[int, int] = {}
    for s in batch.samples:
        most[s.episode] = max(most.get(s.episode, 0), int(s.trace.visible_counts().max()))
    n = max(1, batch.stats.episodes)
    return {
        f"{prefix}kv/visible_max_mean": sum(most.values()) / max(1, len(most)),
        f"{prefix}tokens_forwarded_per_episode": batch.stats.tokens_forwarded / n,
        f"{prefix}recalls_per_episode": batch.stats.recalls / n,
    }

"""One door to sampling: episodes of any environment, single-turn or multi-turn, with KV compression
(an eviction policy), compaction (a strategy) and recall as configured, built in one place.

:class:`SamplerSpec` is what to sample with besides the model and the sampling law; it is built from a
config's ``[rollout]`` section by :meth:`SamplerSpec.from_rollout` (training, evaluation, experiments)
or from the CLI's flags, so no caller decides on its own which engine runs. :func:`sample_episodes`
runs the episodes and gives one :class:`~kvstreams.episodes.EpisodeResult` per environment and the
batch's :class:`~kvstreams.cost.RolloutCost`. Both kinds run on the one session class,
:class:`~kvstreams.engine.stream.StreamSession`:

- a single-turn environment (``gsm8k``, ``recall``, ``bandit``): its prompts in one batch
  (:meth:`StreamSession.for_prompts` and :meth:`StreamSession.generate`: dense prefill, per-step
  eviction by the policy), one trace per episode, scored by the environment
  (:mod:`kvstreams.single_turn`);
- a multi-turn one: :class:`~kvstreams.episodes.EpisodeRunner`, the environment loop, over a session
  of streams (compaction in ``stream`` / ``reprefill`` / ``full`` mode, the policy compressing inside,
  recall).

Either way the session writes one :class:`~kvstreams.engine.record.Record` per sequence and one
visibility record in its :class:`~kvstreams.engine.cache.SlotCache`, and draws with
:mod:`kvstreams.sampling`. What still differs is the policy's schedule (a single-turn batch's
per-step :class:`~kvstreams.engine.compression.StepSchedule`, a stream's
:class:`~kvstreams.engine.compression.StreamBudget`; that module says why they stay two) and who
drives the session (:meth:`StreamSession.generate` samples a single-turn batch itself; the episode
runner samples replies and feeds them through :meth:`StreamSession.forward`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstreams.chat import ChatFormat
from kvstreams.compaction import CompactionStrategy, make_strategy
from kvstreams.compaction.recall import Recall, make_recall
from kvstreams.cost import RolloutCost
from kvstreams.engine import StreamSession
from kvstreams.envs import Environment, is_single_turn
from kvstreams.envs.base import failure
from kvstreams.episodes import CompactionMode, EpisodeResult, EpisodeRunner
from kvstreams.policies import EvictionPolicy, make_policy
from kvstreams.sampling import SamplingParams
from kvstreams.single_turn import env_prompts, reply_reward


@dataclass(frozen=True)
class SamplerSpec:
    """What the episodes are sampled with, besides the model and :class:`SamplingParams`."""

    env: str  # the environment's registered name (single-turn or multi-turn)
    strategy: CompactionStrategy | None = None  # multi-turn compaction (None in mode "full")
    mode: CompactionMode = "full"
    policy: EvictionPolicy | None = None  # KV compression while sampling (None: full KV)
    recall: Recall | None = None  # what comes back after a compaction (multi-turn, compacting modes)
    block_size: int = 1  # multi-turn: pad units to blocks of this many tokens
    max_reply_tokens: int = 64  # multi-turn: the longest reply per turn
    model_name: str = ""

    @classmethod
    def from_rollout(cls, rollout: Any, mode: str | None = None, model_name: str = "") -> SamplerSpec:
        """The spec of a config's ``[rollout]`` section, in ``mode`` (default: the section's; an
        evaluation may run another). Strategy and recall only where something is compacted."""
        r, mode = rollout, mode or rollout.mode
        compacting = mode != "full" and not is_single_turn(r.env)
        return cls(
            env=r.env,
            strategy=make_strategy(r.strategy, preset=r.strategy_preset, **r.strategy_args)
            if r.strategy and compacting
            else None,
            mode=mode,
            policy=make_policy(r.policy, **r.policy_args) if r.policy else None,
            recall=make_recall(r.recall, **r.recall_args) if r.recall and compacting else None,
            block_size=r.block_size,
            max_reply_tokens=r.max_reply_tokens,
            model_name=model_name,
        )

    @property
    def single_turn(self) -> bool:
        return is_single_turn(self.env)


def sample_episodes(
    model,
    tokenizer,
    spec: SamplerSpec,
    envs: Sequence[Environment],
    seeds: Sequence[int],
    sampling: SamplingParams,
    sample_seeds: Sequence[int] | None = None,
    weights_version: int = 0,
    on_step: Callable[[int, Any], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[EpisodeResult], RolloutCost]:
    """One episode per (environment, seed), in order. ``seeds`` seed the environments, ``sample_seeds``
    (default: the same) the sampling: per episode in multi-turn runs; a single-turn batch draws from
    one generator seeded with ``sampling.seed + sample_seeds[0]``. ``on_step(n, target)`` runs after
    every decode step and may call ``target.update_weights`` (asynchronous training)."""
    sample_seeds = list(seeds) if sample_seeds is None else list(sample_seeds)
    if spec.single_turn:
        params = dataclasses.replace(sampling, seed=sampling.seed + sample_seeds[0])
        return _single_turn(model, tokenizer, spec, envs, seeds, params, weights_version, on_step, progress)
    runner = EpisodeRunner(
        model,
        tokenizer,
        spec.strategy,
        mode=spec.mode,
        sampling=sampling,
        block_size=spec.block_size,
        max_reply_tokens=spec.max_reply_tokens,
        model_name=spec.model_name,
        weights_version=weights_version,
        policy=spec.policy,
        recall=spec.recall,
    )
    return runner.run(envs, seeds, on_step=on_step, progress=progress, sample_seeds=sample_seeds)


def _single_turn(
    model, tokenizer, spec, envs, seeds, params, weights_version, on_step, progress
) -> tuple[list[EpisodeResult], RolloutCost]:
    """The environments' prompts in one batch, one reply each, scored by the environment; an
    environment that raises scores 0 and says why (the batch goes on)."""
    chat = ChatFormat(tokenizer)
    prompts = env_prompts(chat, envs, seeds)
    session = StreamSession.for_prompts(model, prompts, params, spec.policy, weights_version)
    traces = session.generate(tokenizer, spec.model_name, progress=progress, on_step=on_step)
    results = []
    for i, (env, trace, seed) in enumerate(zip(envs, traces, seeds, strict=True)):
        try:
            reward, error = reply_reward(env, chat, trace), None
        except Exception as err:  # one environment failing must not take the batch down
            reward, error = 0.0, f"seed {seed}: {failure(err)}"
        results.append(EpisodeResult(i, seed, reward, [trace], {}, [], error))
    cost = RolloutCost(
        episodes=len(traces),
        tokens_forwarded=sum(len(t) - 1 for t in traces),
        tokens_trace=sum(len(t) for t in traces),
        kv_peak_bytes=session.stats.kv_bytes_allocated,
        # the most entries a query attended to (per layer and head), as the episode runner counts it;
        # the session's slot capacity is only what was allocated
        kv_peak_entries=max(int(t.visible_counts().max()) for t in traces),
        reward_mean=sum(r.reward for r in results) / len(results),
    )
    return results, cost

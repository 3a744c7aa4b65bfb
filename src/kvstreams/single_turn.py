"""Single-turn episodes: an environment's prompt, one sampled reply, the environment's reward.

Single-turn environments (``gsm8k``, ``recall``) and runs with a KV compression policy are sampled as
one batch of prompts by the session (:meth:`~kvstreams.engine.stream.StreamSession.generate`, or
:class:`~kvstreams.engine.RolloutEngine` in front of it), not by the episode runner: ``kvstreams
rollout`` and ``verify``, training rollouts (:mod:`kvstreams.train.rollouts`) and the benchmarks all
do it. This is the one place that says what such an episode's prompt is and how its reply is scored,
so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvstreams.chat import ChatFormat
from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.envs import Environment
from kvstreams.envs.base import checked_messages, checked_step
from kvstreams.trace import Trace


def env_prompts(chat: ChatFormat, envs: Sequence[Environment], seeds: Sequence[int]) -> list[list[int]]:
    """Each environment reset with its seed: its opening messages, then the assistant header, so that
    what is sampled next is the model's reply."""
    return [
        chat.head(checked_messages(env.reset(seed), "reset")) + chat.assistant_header()
        for env, seed in zip(envs, seeds, strict=True)
    ]


def reply_reward(env: Environment, chat: ChatFormat, trace: Trace) -> float:
    """The environment's reward for the reply sampled in ``trace`` (its sampled tokens, decoded)."""
    reply = trace.tokens[trace.sampled_mask].tolist()
    return checked_step(env, env.step(chat.decode(reply))).reward


def sample_in_batches(
    engine: RolloutEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    batch_size: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Trace], list[int]]:
    """Sample ``prompts`` ``batch_size`` at a time: (traces, eviction events per sequence).

    Batches bound memory; each is seeded with ``params.seed`` plus its first prompt's index, so
    batches draw differently from one another and a rerun with the same seed draws the same tokens.
    """
    traces: list[Trace] = []
    events: list[int] = []
    for i in range(0, len(prompts), batch_size):
        batch_params = dataclasses.replace(params, seed=params.seed + i)
        traces += engine.generate(prompts[i : i + batch_size], batch_params, progress=progress)
        events += engine.last_stats.eviction_events
    return traces, events

"""Measurements an experiment adds to a held-out evaluation, registered by name.

Each is a function ``(source, n) -> {name: value}`` run on the trained weights
(:class:`~kvstreams.train.rollouts.RolloutSource` holds them and the run's config).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstreams.envs import make_env
from kvstreams.errors import KVStreamsError
from kvstreams.trace import Trace
from kvstreams.train.rollouts import RolloutSource, evaluation_plan

Measure = Callable[[RolloutSource, int], dict[str, float]]
MEASURES: dict[str, Measure] = {}


def register(name: str):
    def wrap(fn: Measure) -> Measure:
        MEASURES[name] = fn
        return fn

    return wrap


def measure(name: str, source: RolloutSource, n: int) -> dict[str, float]:
    if name not in MEASURES:
        raise KVStreamsError(f"unknown measure {name!r}; choose one of {', '.join(sorted(MEASURES))}")
    return MEASURES[name](source, n)


def visible_before_last_reply(trace: Trace) -> torch.Tensor:
    """Token ids the model could see when it began its last reply: the entries visible (on every layer
    and head) to the query that sampled the reply's first token."""
    sampled = trace.sampled_mask
    prompt_positions = torch.nonzero(~sampled).flatten()
    first = int(prompt_positions[-1]) + 1 if prompt_positions.numel() else 0  # the last reply's start
    q = first - 1  # the query whose logits sampled token `first`
    seen = trace.visible_to(q).all(dim=1).all(dim=0)  # evicted anywhere: not carried for sure
    return trace.tokens[seen]


@register("fact_survival")
def fact_survival(source: RolloutSource, n: int) -> dict[str, float]:
    """``memory``: the share of facts whose value is still in the visible context when the agent starts
    its final answer (stated in the first observation, the value survives only if it was restated in
    a retained reply or bridge, or if nothing was compacted), and the reward of the same episodes."""
    r = source.cfg.rollout
    if r.env != "memory":
        raise KVStreamsError("measure 'fact_survival' is defined on the memory environment")
    plan = evaluation_plan(source.cfg, n, greedy=False)
    batch = source.run(plan)
    last = {s.episode: s for s in batch.samples}  # re-prefill mode: an episode's segments, in order
    survived = total = 0
    for seed, sample in zip(plan.env_seeds, [last[i] for i in sorted(last)], strict=True):
        env = make_env(r.env, **r.env_args)
        env.reset(seed)
        text = source.chat.decode(visible_before_last_reply(sample.trace).tolist())
        for kind, value in env.facts.items():
            survived += f"{kind}={value}" in text.replace(" ", "") or f"the {kind} is {value}" in text
            total += 1
    return {
        "fact_survival": survived / max(1, total),
        "fact_survival_reward": sum(batch.rewards) / len(batch.rewards),
    }

"""``kvstreams verify``: sample, replay, and measure sampler/learner agreement.

For every eviction policy (compression while sampling) and every compaction strategy (multi-turn
episodes in stream mode), the shadow learner (recorded visibility) must reproduce the sampler's
log-probs to float precision; the dense learner (plain causal attention, the naive baseline) shows
the off-policy gap that eviction opens when the record is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from kvstreams.compaction import CompactionStrategy
from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.envs import Environment
from kvstreams.episodes import EpisodeRunner
from kvstreams.policies import EvictionPolicy
from kvstreams.replay import replay_logprobs
from kvstreams.trace import Trace
from kvstreams.train.mismatch import mismatch_metrics

# Sampler and learner run the same math in different shapes (one-token decode vs whole-trace forward);
# in float32 that is rounding noise, in half precision the per-token rounding differs visibly.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 2e-2}


@dataclass
class Agreement:
    """Sampler vs learner log-probs over all sampled tokens of a set of traces (the training loop's
    ``mismatch/*`` figures, :mod:`kvstreams.train.mismatch`)."""

    max_abs_diff: float  # mismatch/abs_logprob_diff_max
    mean_abs_diff: float  # mismatch/abs_logprob_diff_mean
    kl_k3: float  # mismatch/k3_kl: k3 estimator of KL(sampler || learner)

    @classmethod
    def measure(cls, traces: Sequence[Trace], learner_logprobs: Sequence[torch.Tensor]) -> Agreement:
        learner = torch.cat([lp[t.sampled_mask] for t, lp in zip(traces, learner_logprobs, strict=True)])
        sampler = torch.cat([t.sampler_logprobs[t.sampled_mask] for t in traces])
        seq = torch.cat([torch.full((int(t.sampled_mask.sum()),), i) for i, t in enumerate(traces)])
        m = mismatch_metrics(learner, sampler, seq)
        if not learner.numel():
            return cls(0.0, 0.0, 0.0)
        return cls(
            m["mismatch/abs_logprob_diff_max"], m["mismatch/abs_logprob_diff_mean"], m["mismatch/k3_kl"]
        )


@dataclass
class Report:
    """Agreement for one eviction policy or one compaction strategy (stream mode)."""

    name: str
    kind: str  # "policy" or "strategy"
    sequences: int
    tokens: int  # trace tokens
    sampled_tokens: int
    eviction_events: int  # eviction rounds (policies) or compactions (strategies)
    min_events_per_sequence: int
    evicted_entries: int  # summed over layers and KV heads
    kv_saving: float  # mean over traces of Trace.kv_saving (SMD's "Toks. saving")
    shadow: Agreement
    dense: Agreement
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.shadow.max_abs_diff <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def report_for(
    model, name: str, kind: str, traces: list[Trace], events: list[int], backend: str = "sdpa"
) -> Report:
    """Replay ``traces`` with the shadow and dense learners and compare both with the sampler."""
    shadow = replay_logprobs(model, traces, mode="shadow", backend=backend)
    dense = replay_logprobs(model, traces, mode="dense", backend=backend)
    return Report(
        name=name,
        kind=kind,
        sequences=len(traces),
        tokens=sum(len(t) for t in traces),
        sampled_tokens=int(sum(int(t.sampled_mask.sum()) for t in traces)),
        eviction_events=sum(events),
        min_events_per_sequence=min(events) if events else 0,
        evicted_entries=sum(t.n_evicted for t in traces),
        kv_saving=sum(t.kv_saving() for t in traces) / max(1, len(traces)),
        shadow=Agreement.measure(traces, shadow),
        dense=Agreement.measure(traces, dense),
        tolerance=TOLERANCE.get(model.dtype, 1e-4),
    )


def verify_policy(
    model,
    tokenizer,
    policy: EvictionPolicy,
    prompts: list[list[int]],
    params: SamplingParams,
    backend: str = "sdpa",
    progress: Callable[[int], None] | None = None,
) -> tuple[Report, list[Trace]]:
    engine = RolloutEngine(model, tokenizer, policy)
    traces = engine.generate(prompts, params, progress=progress)
    return report_for(
        model, policy.name, "policy", traces, engine.last_stats.eviction_events, backend
    ), traces


def verify_strategy(
    model,
    tokenizer,
    strategy: CompactionStrategy,
    envs: list[Environment],
    seeds: list[int],
    params: SamplingParams,
    backend: str = "sdpa",
    progress: Callable[[int], None] | None = None,
    **runner_options,
) -> tuple[Report, list[Trace]]:
    """Run episodes in stream mode (one trace each) and replay them."""
    runner = EpisodeRunner(model, tokenizer, strategy, mode="stream", sampling=params, **runner_options)
    results, _ = runner.run(envs, seeds, progress=progress)
    traces = [t for r in results for t in r.traces]
    events = [len(r.compactions) for r in results]
    return report_for(model, strategy.name, "strategy", traces, events, backend), traces

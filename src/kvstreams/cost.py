"""What a batch of episodes cost, and the KV-streams paper's closed form for re-prefill's extra cost.

The episode runner counts (tokens forwarded, re-prefilled, peak KV, seconds); this module turns the
counts into :class:`RolloutCost`, whose keys are those of a rollout's ``summary.json`` and of
``train``'s ``rollout/*`` metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstreams.engine.stream import SessionCounters
from kvstreams.errors import KVStreamsError


@dataclass
class RolloutCost:
    """What a batch of episodes cost. Keys match ``summary.json``."""

    episodes: int = 0
    tokens_forwarded: int = 0
    tokens_reprefilled: int = 0
    tokens_filler: int = 0
    tokens_trace: int = 0
    kv_peak_entries: int = 0
    kv_peak_bytes: int = 0
    compactions: int = 0
    retained_mean: float = 0.0  # r: live tokens right after a compaction
    context_at_compaction_mean: float = 0.0  # B as it happened: live tokens when a compaction fired
    tokens_reprefilled_predicted: float = 0.0  # N * r / (B - r), N = tokens_forwarded - tokens_reprefilled
    tokens_first_fill: int = 0  # N0: tokens forwarded before each episode's first compaction (summed)
    # (N - N0) * r / (B - r): the same formula over the steady state only (the first fill from 0 to B
    # re-prefills nothing, which the closed form does not know)
    tokens_reprefilled_predicted_steady: float = 0.0
    reward_mean: float = 0.0
    seconds: float = 0.0
    decode_tokens: int = 0  # tokens fed one per row per forward (the model's replies)
    decode_seconds: float = 0.0  # time in those forwards
    chunk_seconds: float = 0.0  # time in forwards of longer chunks (prompts, observations, re-prefills)
    observations_truncated: int = 0  # observations cut to fit the KV budget
    recalls: int = 0  # deleted units brought back (compaction.recall)
    tokens_recalled: int = 0  # their tokens (restored from the archive, or fed again to recompute)
    kv_archive_peak_bytes: int = 0  # most K/V bytes held in the recall archive (beside the cache)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def reprefill_closed_form(new_tokens: float, retained: float, budget: float) -> float:
    """The KV-streams paper's extra prefill of re-prefill compaction: N * r / (B - r)."""
    if retained >= budget:
        raise KVStreamsError(
            f"retained r = {retained:.0f} >= budget B = {budget:.0f}: re-prefill cost diverges"
        )
    return new_tokens * retained / (budget - retained)


def rollout_cost(
    counters: SessionCounters,
    rewards: Sequence[float],
    events: Sequence[dict[str, Any]],
    first_fill: int,
    **counts: Any,
) -> RolloutCost:
    """The cost of a batch from its session's ``counters``, its episodes' ``rewards``, their
    compaction ``events`` (each with ``retained`` and ``live_before``) and ``first_fill`` (tokens
    forwarded before each compacting episode's first compaction, summed); ``counts``: the other
    fields as counted by the runner (``tokens_filler``, ``tokens_trace``, ``seconds``, ...)."""
    cost = RolloutCost(
        episodes=len(rewards),
        tokens_forwarded=counters.tokens_forwarded,
        tokens_reprefilled=counters.tokens_reprefilled,
        kv_peak_entries=counters.kv_peak_entries,
        kv_peak_bytes=counters.kv_peak_bytes,
        kv_archive_peak_bytes=counters.archive_peak_bytes,
        compactions=len(events),
        reward_mean=sum(rewards) / len(rewards),
        decode_tokens=counters.decode_tokens,
        decode_seconds=round(counters.decode_seconds, 3),
        chunk_seconds=round(counters.chunk_seconds, 3),
        **counts,
    )
    if events:
        cost.retained_mean = sum(e["retained"] for e in events) / len(events)
        cost.context_at_compaction_mean = sum(e["live_before"] for e in events) / len(events)
        cost.tokens_first_fill = first_fill
        _predict_reprefill(cost)
    return cost


def _predict_reprefill(cost: RolloutCost) -> None:
    """Fill in the closed form's predictions from the cost's own counts and compaction means (when
    compaction left fewer tokens than it found: otherwise the form diverges)."""
    r, b = cost.retained_mean, cost.context_at_compaction_mean
    if r < b:
        new_tokens = cost.tokens_forwarded - cost.tokens_reprefilled
        cost.tokens_reprefilled_predicted = reprefill_closed_form(new_tokens, r, b)
        cost.tokens_reprefilled_predicted_steady = reprefill_closed_form(
            new_tokens - cost.tokens_first_fill, r, b
        )


def merge_costs(parts: Sequence[RolloutCost]) -> RolloutCost:
    """The cost of a batch run in shards (one per rollout worker): counts and times add up (a worker's
    seconds are its own; ``seconds`` is the slowest shard's, the batch's wall-clock), peak KV bytes add
    up (each worker holds its own cache), peak entries are the largest; the means are weighted by each
    shard's compactions and the closed form is recomputed over the whole batch, so the figures are those
    one process would report for the same episodes."""
    total = RolloutCost()
    for name in ("episodes", "tokens_forwarded", "tokens_reprefilled", "tokens_filler", "tokens_trace",
                 "kv_peak_bytes", "compactions", "tokens_first_fill", "decode_tokens",
                 "observations_truncated", "recalls", "tokens_recalled",
                 "kv_archive_peak_bytes"):  # fmt: skip
        setattr(total, name, sum(getattr(p, name) for p in parts))
    total.kv_peak_entries = max((p.kv_peak_entries for p in parts), default=0)
    total.decode_seconds = round(sum(p.decode_seconds for p in parts), 3)
    total.chunk_seconds = round(sum(p.chunk_seconds for p in parts), 3)
    total.seconds = max((p.seconds for p in parts), default=0.0)
    if total.episodes:
        total.reward_mean = sum(p.reward_mean * p.episodes for p in parts) / total.episodes
    if total.compactions:
        total.retained_mean = sum(p.retained_mean * p.compactions for p in parts) / total.compactions
        total.context_at_compaction_mean = (
            sum(p.context_at_compaction_mean * p.compactions for p in parts) / total.compactions
        )
        _predict_reprefill(total)
    return total

"""What ``kvstreams rollout`` writes: the trace files' names and the ``summary.json`` beside them.

Two kinds of rollout, two summaries: single-turn sampling with an eviction policy (one trace per
sequence, ``trace-NNNNN``) and multi-turn episodes with a compaction strategy (one trace per episode,
or one per segment in re-prefill mode, ``episode-NNNNN[-segKK]``). The keys are a file format that
readers of earlier runs rely on; they are built here, apart from the command's printing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstreams.compaction import CompactionStrategy
from kvstreams.cost import RolloutCost
from kvstreams.engine import GenerationStats
from kvstreams.episodes import EpisodeResult
from kvstreams.policies import EvictionPolicy
from kvstreams.trace import Trace


def save_policy_traces(traces: list[Trace], out: Path) -> list[str]:
    """One file per sequence, numbered in prompt order; their names."""
    return [trace.save(out / f"trace-{i:05d}.safetensors").name for i, trace in enumerate(traces)]


def policy_summary(
    policy: EvictionPolicy,
    model: str,
    env: str | None,
    traces: list[Trace],
    events: list[int],
    last_batch: GenerationStats,
    rewards: list[float] | None,
    seconds: float,
    names: list[str],
) -> dict[str, Any]:
    """A single-turn rollout: the policy, token counts, eviction and KV saving per sequence, rewards
    (None without an environment). Budgets and KV capacity are the last batch's (``last_batch``)."""
    return {
        "policy": policy.describe(),
        "model": model,
        "env": env,
        "episodes": len(traces),
        "tokens_trace": sum(len(t) for t in traces),
        "tokens_sampled": sum(int(t.sampled_mask.sum()) for t in traces),
        "eviction_events": events,
        "budget_entries": last_batch.budgets,
        # SMD's "Toks. saving": 1 - KV entries the sampled tokens' queries saw / a full cache's
        "kv_saving": [round(t.kv_saving(), 4) for t in traces],
        "kv_saving_mean": sum(t.kv_saving() for t in traces) / len(traces),
        "kv_capacity_entries": last_batch.kv_capacity,
        "rewards": rewards,
        "reward_mean": None if rewards is None else sum(rewards) / len(rewards),
        "seconds": round(seconds, 3),
        "traces": names,
    }


def save_episode_traces(results: list[EpisodeResult], out: Path, mode: str) -> list[str]:
    """One file per episode; in re-prefill mode one per segment (``-segKK``). Their names."""
    names = []
    for r in results:
        for k, trace in enumerate(r.traces):
            suffix = f"-seg{k:02d}" if mode == "reprefill" else ""
            names.append(trace.save(out / f"episode-{r.episode:05d}{suffix}.safetensors").name)
    return names


def episode_summary(
    stats: RolloutCost,
    results: list[EpisodeResult],
    mode: str,
    env: str,
    strategy: CompactionStrategy | None,
    model: str,
    block_size: int,
    names: list[str],
) -> dict[str, Any]:
    """Multi-turn episodes: what they cost (:class:`~kvstreams.cost.RolloutCost`), the run's
    settings and each episode's outcome. The closed-form re-prefill predictions are kept in re-prefill
    mode only, where they predict something measured."""
    summary = {
        **stats.as_dict(),
        "mode": mode,
        "env": env,
        "strategy": strategy.describe() if strategy else None,
        "model": model,
        "block_size": block_size,
        "episode_results": [
            {
                "episode": r.episode,
                "seed": r.seed,
                "reward": r.reward,
                "compactions": len(r.compactions),
                "segments": len(r.traces),
                "end": r.info.get("end"),
            }
            for r in results
        ],
        "traces": names,
    }
    if mode != "reprefill":
        summary.pop("tokens_reprefilled_predicted")
        summary.pop("tokens_reprefilled_predicted_steady")
    return summary

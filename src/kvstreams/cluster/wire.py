"""What crosses process boundaries: traces and weights as safetensors bytes, the rest as plain lists.

Rollout workers send their share of a batch back through Ray's object store. Nothing in it is a
pickled object of unknown origin: each trace is the bytes of its ``.safetensors`` file (validated on
arrival exactly as a file is, :meth:`Trace.from_bytes`), the cost is a dict of numbers with known
keys, rewards and groups are numbers, errors strings. Weights go the other way as one safetensors
blob per version.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

import torch

from kvstreams.cost import RolloutCost, merge_costs
from kvstreams.errors import KVStreamsError
from kvstreams.trace import Trace
from kvstreams.train.rollouts import EpisodePlan, RolloutBatch, Sample

_COST_FIELDS = {f.name: f.type for f in fields(RolloutCost)}


def batch_to_wire(batch: RolloutBatch) -> dict[str, Any]:
    """A rollout batch as safetensors bytes (one per trace) and plain numbers and strings."""
    return {
        "traces": [s.trace.to_bytes() for s in batch.samples],
        "samples": [[s.group, s.episode, float(s.reward)] for s in batch.samples],
        "rewards": [float(r) for r in batch.rewards],
        "errors": [e if e is None else str(e) for e in batch.errors],
        "outcomes": [dict(o) for o in batch.outcomes],
        "cost": batch.stats.as_dict(),
    }


def batch_from_wire(payload: dict[str, Any], where: str = "rollout worker") -> RolloutBatch:
    """The batch :func:`batch_to_wire` sent; anything but the expected keys and types is an error."""
    if not isinstance(payload, dict) or set(payload) != {
        "traces",
        "samples",
        "rewards",
        "errors",
        "outcomes",
        "cost",
    }:
        raise KVStreamsError(f"{where}: not a rollout batch")
    traces, rows = payload["traces"], payload["samples"]
    if not all(isinstance(t, bytes) for t in traces) or len(traces) != len(rows):
        raise KVStreamsError(f"{where}: traces must be safetensors bytes, one per sample")
    samples = []
    for i, (data, row) in enumerate(zip(traces, rows, strict=True)):
        group, episode, reward = _typed(row, (int, int, float), f"{where}: sample {i}")
        samples.append(Sample(Trace.from_bytes(data, where=f"{where}: trace {i}"), group, episode, reward))
    rewards = [_typed([r], (float,), f"{where}: reward")[0] for r in payload["rewards"]]
    errors = payload["errors"]
    if not all(e is None or isinstance(e, str) for e in errors):
        raise KVStreamsError(f"{where}: errors must be strings or None")
    cost = payload["cost"]
    if not isinstance(cost, dict) or set(cost) != set(_COST_FIELDS):
        raise KVStreamsError(f"{where}: the cost has unexpected keys")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in cost.values()):
        raise KVStreamsError(f"{where}: the cost must be numbers")
    outcomes = payload["outcomes"]
    if not all(
        isinstance(o, dict) and all(isinstance(k, str) and isinstance(v, float) for k, v in o.items())
        for o in outcomes
    ):
        raise KVStreamsError(f"{where}: outcomes must map names to floats")
    return RolloutBatch(samples, rewards, RolloutCost(**cost), errors=list(errors), outcomes=list(outcomes))


def _typed(values: Any, types: tuple[type, ...], where: str) -> list[Any]:
    ok = isinstance(values, list | tuple) and len(values) == len(types)
    ok = ok and all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(values, types, strict=True))
    if not ok:
        raise KVStreamsError(f"{where}: expected {', '.join(t.__name__ for t in types)}")
    return list(values)


def plan_to_wire(plan: EpisodePlan) -> dict[str, Any]:
    return asdict(plan)


def plan_from_wire(data: dict[str, Any]) -> EpisodePlan:
    return EpisodePlan(**data)


def state_to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """Model weights as one safetensors blob (tied weights are written once per name: cloned)."""
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()})


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def merge_batches(parts: list[RolloutBatch]) -> RolloutBatch:
    """Shards of one plan, in plan order, as one batch: the episodes are numbered across shards (groups
    are the plan's own numbers already), costs merged (:func:`~kvstreams.cost.merge_costs`)."""
    samples, rewards, errors, outcomes, offset = [], [], [], [], 0
    for part in parts:
        samples += [Sample(s.trace, s.group, s.episode + offset, s.reward) for s in part.samples]
        rewards += part.rewards
        errors += part.errors or [None] * len(part.rewards)
        outcomes += part.outcomes or [{} for _ in part.rewards]
        offset += len(part.rewards)
    cost = merge_costs([p.stats for p in parts])
    return RolloutBatch(samples, rewards, cost, errors=errors, outcomes=outcomes)

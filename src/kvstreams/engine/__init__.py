"""Rollout engine: batched sampling with a budget-bounded KV cache that evicts in place."""

from kvstreams.engine.engine import RolloutEngine, RolloutStats
from kvstreams.engine.sampling import SamplingParams

__all__ = ["RolloutEngine", "RolloutStats", "SamplingParams"]

"""Rollout engine: batched sampling with a budget-bounded KV cache that evicts in place."""

from kvstreams.engine.engine import GenerationStats, RolloutEngine
from kvstreams.engine.sampling import SamplingParams

__all__ = ["GenerationStats", "RolloutEngine", "SamplingParams"]

"""Rollout engine: batched sampling with a budget-bounded KV cache that evicts in place."""

from kvstreams.engine.engine import GenerationStats, RolloutEngine
from kvstreams.sampling import SamplingParams  # re-exported: the law sampler and learner share

__all__ = ["GenerationStats", "RolloutEngine", "SamplingParams"]

"""The sampler: one session class (:class:`StreamSession`) for single-turn batches and multi-turn
streams, over a budget-bounded KV cache that evicts in place; :class:`RolloutEngine` is its
single-turn front for bare prompts."""

from kvstreams.engine.engine import RolloutEngine
from kvstreams.engine.stream import GenerationStats, StreamSession
from kvstreams.sampling import SamplingParams  # re-exported: the law sampler and learner share

__all__ = ["GenerationStats", "RolloutEngine", "SamplingParams", "StreamSession"]

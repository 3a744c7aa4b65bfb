"""Eviction policies (the Shadow Mask paper's rollout side), one module each, registered by name."""

from kvstreams.policies import full, h2o, knorm, random_selection, recent, snapkv, streaming_llm  # noqa: F401  (registration)
from kvstreams.policies.base import POLICIES, EntryView, EvictionPolicy, make_policy, parse_budget, register

__all__ = ["POLICIES", "EntryView", "EvictionPolicy", "make_policy", "parse_budget", "register"]

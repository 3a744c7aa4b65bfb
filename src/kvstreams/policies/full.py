"""Full: never evict (the uncompressed reference; the cache holds the whole context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstreams.policies.base import EntryView, EvictionPolicy, register


@register("full")
@dataclass
class FullCache(EvictionPolicy):
    budget: float | int = 1.0

    def resolve_budget(self, context_len: int) -> int:
        return context_len + 1  # never full: nothing is ever evicted

    def check_budget(self, budget: int) -> None:
        return None

    def evicts(self) -> bool:
        return False

    def score(self, view: EntryView) -> torch.Tensor:
        return torch.zeros(view.index.shape, device=view.index.device)

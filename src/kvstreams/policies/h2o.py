"""H2O: heavy hitters plus a recent window.

Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models". Every entry accumulates the attention it receives from every query (summed over the query
heads of its KV group); once the cache is full, each step evicts the entry with the lowest
accumulated score, except the most recent ``recent_ratio`` share of the kept entries.

Defaults: ``recent_ratio`` 0.5 (half heavy hitters, half recent, the paper's split), one entry per
step (``interval`` 1), budget 50% of the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstreams.errors import KVStreamsError
from kvstreams.policies.base import EntryView, EvictionPolicy, register


@register("h2o")
@dataclass
class H2O(EvictionPolicy):
    needs: ClassVar[frozenset[str]] = frozenset({"cumulative"})

    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent_ratio < 1.0:
            raise KVStreamsError(f"h2o: recent_ratio must be in [0, 1), got {self.recent_ratio}")

    def n_protected(self, budget: int) -> int:
        return int(self.recent_ratio * (budget - self.interval))

    def score(self, view: EntryView) -> torch.Tensor:
        assert view.attn_cumulative is not None
        return view.attn_cumulative

    def protected(self, view: EntryView) -> torch.Tensor:
        recent = (self.recent_ratio * (view.budget - self.interval)).long()
        return view.index > (view.query_index - recent)[:, None, None]

"""StreamingLLM: attention sinks plus the most recent entries.

Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks". The first ``n_sink``
tokens are always kept (they absorb attention mass); the rest of the budget holds the most recent
entries. The decision is the same for every layer and head.

Defaults: 4 sinks (the paper's), one entry evicted per step, budget 50% of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstreams.errors import KVStreamsError
from kvstreams.policies.base import EntryView, EvictionPolicy, register


@register("streaming_llm")
@dataclass
class StreamingLLM(EvictionPolicy):
    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_sink < 0:
            raise KVStreamsError(f"streaming_llm: n_sink must be >= 0, got {self.n_sink}")

    def n_protected(self, budget: int) -> int:
        return self.n_sink

    def score(self, view: EntryView) -> torch.Tensor:
        return view.index.float()

    def protected(self, view: EntryView) -> torch.Tensor:
        return (view.index >= 0) & (view.index < self.n_sink)

"""Recent: keep only the most recent entries (a plain sliding window over the cache).

The "Recent" selection strategy of the Shadow Mask Distillation paper's ablation (its Table 5);
StreamingLLM without sinks. The decision is the same for every layer and head.

Defaults: one entry evicted per step, budget 50% of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstreams.policies.base import EntryView, EvictionPolicy, register


@register("recent")
@dataclass
class Recent(EvictionPolicy):
    def score(self, view: EntryView) -> torch.Tensor:
        return view.index.float()

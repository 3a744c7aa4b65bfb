"""Random: keep a random subset of entries, independently per layer and KV head.

The "Random" selection strategy of the Shadow Mask Distillation paper's ablation (its Table 5),
a lower bound for informed policies. Draws come from the engine's seeded generator, so a rollout
is reproducible under its seed.

Defaults: interval 16 (an eviction round every 16 steps), budget 50% of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstreams.policies.base import EntryView, EvictionPolicy, register


@register("random")
@dataclass
class RandomPolicy(EvictionPolicy):
    interval: int = 16

    def score(self, view: EntryView) -> torch.Tensor:
        return torch.rand(view.index.shape, generator=view.generator, device=view.index.device)

"""Knorm: keep the keys with the smallest L2 norm.

Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression":
low-norm keys tend to receive high attention, so they are kept. Per layer and KV head.

Defaults: interval 16, budget 50% of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstreams.policies.base import EntryView, EvictionPolicy, register


@register("knorm")
@dataclass
class KNorm(EvictionPolicy):
    interval: int = 16

    def score(self, view: EntryView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)

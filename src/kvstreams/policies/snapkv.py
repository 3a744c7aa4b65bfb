"""SnapKV: keep the entries the observation window attends to.

Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation". The attention that
the last ``window_size`` queries pay to each entry (summed over the query heads of a KV group) is
pooled along the sequence (``kernel_size``) and the top entries are kept per KV head; the window
itself is always kept. As in the Shadow Mask Distillation paper's rollouts, compression runs after
prefill and then every ``interval`` decode steps, each round keeping ``budget - interval`` entries.

Defaults: window 32 and kernel 7 (the SnapKV paper), max pooling off (average pooling), interval 32,
budget 50% of the context (the SMD paper's setting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstreams.errors import KVStreamsError
from kvstreams.policies.base import EntryView, EvictionPolicy, register, sequence_order_pool


@register("snapkv")
@dataclass
class SnapKV(EvictionPolicy):
    needs: ClassVar[frozenset[str]] = frozenset({"window"})

    interval: int = 32
    window: int = 32
    kernel_size: int = 7
    pooling: str = "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise KVStreamsError(f"snapkv: window must be >= 1, got {self.window}")
        if self.pooling not in ("avg", "max"):
            raise KVStreamsError(f"snapkv: pooling must be 'avg' or 'max', got {self.pooling!r}")

    @property
    def window_size(self) -> int:
        return self.window

    def n_protected(self, budget: int) -> int:
        return self.window

    def score(self, view: EntryView) -> torch.Tensor:
        assert view.attn_window is not None
        return sequence_order_pool(view.attn_window, view.index, self.kernel_size, self.pooling)

    def protected(self, view: EntryView) -> torch.Tensor:
        return view.index > (view.query_index - self.window)[:, None, None]

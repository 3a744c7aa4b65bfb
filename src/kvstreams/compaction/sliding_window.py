"""Sliding window: drop the oldest turns, ``stride`` turns at a time, until the new message fits.

The strategy that retains the most context (r close to B, so re-prefill is at its most expensive:
N*r/(B-r)). A turn is the model's reply and the environment's answer to it.

Defaults: the environment's budget (memory 384 tokens, TextWorld 1024), stride 1 turn.

Preset ``kvstreams`` (``make_strategy(name, preset="kvstreams")``): the KV-streams authors'
configuration (turn-triggered, at most 10 turns in the context, the oldest one dropped at a time; their released ``configs/textworld/kv_streams_sliding_window.toml``), with
a token budget of 32,768 (their ``seq_len``) so that turns alone decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvstreams.compaction.base import CompactionStrategy, UnitView, register
from kvstreams.errors import KVStreamsError


@register("sliding_window")
@dataclass
class SlidingWindow(CompactionStrategy):
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "kvstreams": {"max_turns": 10, "drop_turns": 1, "token_budget": 32768}
    }

    stride: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stride < 1:
            raise KVStreamsError(f"sliding_window: stride must be >= 1, got {self.stride}")

    def units_to_delete(self, head: int, units: list[UnitView], incoming: int) -> int:
        live = head + sum(u.length for u in units)
        n = 0
        while n < len(units) - 1 and live + incoming > self.token_budget_in_force:
            step = min(2 * self.stride, len(units) - 1 - n)  # a turn is two units: reply + answer
            live -= sum(u.length for u in units[n : n + step])
            n += step
        return max(n, 1) if len(units) > 1 else 0

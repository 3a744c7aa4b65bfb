"""*When* an episode's context is compacted, apart from *what* a strategy deletes.

kvpress keeps the two apart (``DecodingPress(base_press, compression_interval)``: the wrapper says
when, the press what); so do we. A :class:`Trigger` fires on the token budget (the live context
plus the incoming message would exceed ``token_budget``), every ``turn_budget`` turns since the last
compaction, or when the context holds ``max_turns`` turns. The model itself can also decide to
compact (the ``model_triggered`` strategy's marker): :attr:`Reason.MODEL`.

A strategy's fields configure its trigger (``CompactionStrategy.when``), so configs stay flat:
``token_budget``, ``turn_budget``, ``max_turns`` sit next to the strategy's own options.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    """Why a compaction happened (recorded in each compaction event as ``trigger``)."""

    TOKENS = "tokens"  # the context would exceed the token budget
    TURNS = "turns"  # a turn budget or the most turns the context may hold
    MODEL = "model"  # the model wrote the strategy's marker


@dataclass(frozen=True)
class Trigger:
    token_budget: int  # B: compact when the live context plus the incoming message would exceed it
    turn_budget: int = 0  # > 0: also every this many turns since the last compaction
    max_turns: int = 0  # > 0: also when the context holds this many turns

    def fires(self, live: int, incoming: int, turns_since: int, live_turns: int) -> Reason | None:
        """Why to compact before ``incoming`` tokens join ``live`` ones, or None to go on."""
        if self.max_turns and live_turns >= self.max_turns:
            return Reason.TURNS
        if self.turn_budget and turns_since >= self.turn_budget:
            return Reason.TURNS
        if live + incoming > self.token_budget:
            return Reason.TOKENS
        return None

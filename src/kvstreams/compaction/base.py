"""The compaction-strategy interface and registry (the KV-streams paper's kappa = gen o del).

A strategy decides *when* an episode's context is compacted (a token budget ``budget``, optionally a
turn budget, and for ``model_triggered`` the model's own decision) and *what* is deleted: always the
oldest live units after the protected head (the first message: system + task). Strategies with a
bridge have the model generate it first (a summary after an instruction, or what follows a marker);
the bridge stays, the span before it goes.

The runner applies the decision in one of three modes (``stream``: evict in place, one trace;
``reprefill``: new trace from the retained tokens; ``full``: never compact).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from kvstreams.errors import KVStreamsError
from kvstreams.registry import Registry


@dataclass(frozen=True)
class UnitView:
    """One live message of the context after the head: ``kind`` is assistant, env, instruction or bridge."""

    kind: str
    length: int


@dataclass
class CompactionStrategy:
    name: ClassVar[str] = "base"
    #: None, "instruction" (the model summarises after an instruction) or "marker" (the model's own marker)
    bridge: ClassVar[str | None] = None

    #: B: compact when the live context plus the incoming message would exceed it. None: the
    #: environment's ``context_budget`` (its messages' typical size decides what a sensible B is)
    budget: int | None = None
    turn_budget: int = 0  # > 0: also compact every this many turns

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 16:
            raise KVStreamsError(f"{self.name}: budget must be at least 16 tokens, got {self.budget}")
        if self.turn_budget < 0:
            raise KVStreamsError(f"{self.name}: turn_budget must be >= 0, got {self.turn_budget}")

    def with_budget(self, budget: int) -> CompactionStrategy:
        """This strategy with ``budget`` filled in when it was left to the environment."""
        return self if self.budget is not None else dataclasses.replace(self, budget=budget)

    @property
    def b(self) -> int:
        if self.budget is None:
            raise KVStreamsError(f"{self.name}: no budget set (use with_budget)")
        return self.budget

    def trigger(self, live: int, incoming: int, turns_since: int) -> str | None:
        """Why to compact now ("turns" or "tokens"), or None."""
        if self.turn_budget and turns_since >= self.turn_budget:
            return "turns"
        if live + incoming > self.b:
            return "tokens"
        return None

    def units_to_delete(self, head: int, units: list[UnitView], incoming: int) -> int:
        """How many of the oldest live units after the head (``head`` tokens) to delete to make room for
        ``incoming`` tokens; the newest unit is always kept. Bridge strategies delete every unit
        before the bridge and do not use this."""
        raise NotImplementedError

    def min_retained(self, head: int) -> int:
        """The least a compaction can keep (head + what the strategy always keeps): must stay < budget."""
        return head

    def check(self, head: int) -> None:
        r = self.min_retained(head)
        if r >= self.b:
            raise KVStreamsError(
                f"{self.name}: retained context r = {r} tokens (head {head} + what the strategy keeps) is not "
                f"below the budget B = {self.b}; re-prefill cost N*r/(B-r) would diverge and compaction "
                "could never make room. Raise the budget or keep less."
            )

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, **dataclasses.asdict(self)}


_REGISTRY: Registry[CompactionStrategy] = Registry("compaction strategy")
STRATEGIES = _REGISTRY.entries
register = _REGISTRY.register


def make_strategy(name: str, **kwargs: Any) -> CompactionStrategy:
    return _REGISTRY.make(name, **kwargs)

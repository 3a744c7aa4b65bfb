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

    #: named settings (``make_strategy(name, preset=...)``): "kvstreams" is the KV-streams authors'
    #: configuration of the strategy (their released TextWorld configs)
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    #: B: compact when the live context plus the incoming message would exceed it. None: the
    #: environment's ``context_budget`` (its messages' typical size decides what a sensible B is)
    budget: int | None = None
    turn_budget: int = 0  # > 0: also compact every this many turns since the last compaction
    #: > 0: turn-triggered, compact when the context holds this many turns (a turn: a reply and the
    #: environment's answer to it) ...
    max_turns: int = 0
    #: ... deleting this many of the oldest turns (0: the strategy's own rule decides what goes)
    drop_turns: int = 0

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 16:
            raise KVStreamsError(f"{self.name}: budget must be at least 16 tokens, got {self.budget}")
        if self.turn_budget < 0 or self.max_turns < 0 or self.drop_turns < 0:
            raise KVStreamsError(f"{self.name}: turn_budget, max_turns and drop_turns must be >= 0")
        if self.drop_turns and not 0 < self.drop_turns < self.max_turns:
            raise KVStreamsError(
                f"{self.name}: drop_turns ({self.drop_turns}) needs max_turns above it (got {self.max_turns})"
            )

    def with_budget(self, budget: int) -> CompactionStrategy:
        """This strategy with ``budget`` filled in when it was left to the environment."""
        return self if self.budget is not None else dataclasses.replace(self, budget=budget)

    @property
    def b(self) -> int:
        if self.budget is None:
            raise KVStreamsError(f"{self.name}: no budget set (use with_budget)")
        return self.budget

    def trigger(self, live: int, incoming: int, turns_since: int, live_turns: int = 0) -> str | None:
        """Why to compact now ("turns" or "tokens"), or None. ``live_turns``: turns in the context."""
        if self.max_turns and live_turns >= self.max_turns:
            return "turns"
        if self.turn_budget and turns_since >= self.turn_budget:
            return "turns"
        if live + incoming > self.b:
            return "tokens"
        return None

    def deletion(self, head: int, units: list[UnitView], incoming: int, trigger: str) -> int:
        """How many of the oldest live units after the head go: the oldest ``drop_turns`` turns when a
        turn trigger fired and ``drop_turns`` is set, else the strategy's own :meth:`units_to_delete`."""
        if trigger == "turns" and self.drop_turns:
            return units_of_oldest_turns(units, self.drop_turns)
        return self.units_to_delete(head, units, incoming)

    def units_to_delete(self, head: int, units: list[UnitView], incoming: int) -> int:
        """How many of the oldest live units after the head (``head`` tokens) to delete to make room for
        ``incoming`` tokens; the newest unit is always kept. Bridge strategies are given the units
        before the bridge."""
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


def units_of_oldest_turns(units: list[UnitView], turns: int) -> int:
    """How many of the oldest units hold the oldest ``turns`` turns: everything before the reply
    that starts turn ``turns + 1`` (earlier bridges included). The newest unit always stays."""
    replies = 0
    for i, unit in enumerate(units):
        if unit.kind == "assistant":
            replies += 1
            if replies > turns:
                return i
    return max(0, len(units) - 1)


def live_turns(units: list[UnitView]) -> int:
    return sum(u.kind == "assistant" for u in units)


_REGISTRY: Registry[CompactionStrategy] = Registry("compaction strategy")
STRATEGIES = _REGISTRY.entries
register = _REGISTRY.register


def make_strategy(name: str, preset: str | None = None, **kwargs: Any) -> CompactionStrategy:
    """A registered strategy by name, from a named ``preset`` (its settings first, ``kwargs`` over
    them) or from the defaults."""
    options: dict[str, Any] = {}
    if preset is not None:
        cls = _REGISTRY.entries.get(name)
        if cls is not None:
            if preset not in cls.presets:
                choices = ", ".join(sorted(cls.presets)) or "none"
                raise KVStreamsError(
                    f"compaction strategy {name!r} has no preset {preset!r} (presets: {choices})"
                )
            options.update(cls.presets[preset])
    return _REGISTRY.make(name, **{**options, **kwargs})

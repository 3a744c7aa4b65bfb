"""The compaction-strategy interface and registry (the KV-streams paper's kappa = gen o del).

A strategy decides *what* is deleted when an episode's context is compacted: always the oldest live
units after the protected head (the first message: system + task), how many is the strategy's one
method, :meth:`CompactionStrategy.units_to_delete`. *When* is its :class:`~.trigger.Trigger`
(``strategy.when``: a token budget, optionally turn limits), configured by the same fields so that
configs stay flat. Strategies with a bridge (:class:`Bridge`) have the model generate it first (a
summary after an instruction, or what follows a marker); the bridge stays, the span before it goes.
The bridge protocol (:meth:`~CompactionStrategy.bridge_request`,
:meth:`~CompactionStrategy.bridge_marker`, :meth:`~CompactionStrategy.bridge_limit`) is declared here,
so the episode runner never reaches into a subclass.

The runner applies the decision in one of three modes (``stream``: evict in place, one trace;
``reprefill``: new trace from the retained tokens; ``full``: never compact).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from kvstreams.compaction.trigger import Reason, Trigger
from kvstreams.errors import KVStreamsError
from kvstreams.registry import Registry


class UnitKind(StrEnum):
    """What a message of an episode's context is."""

    HEAD = "head"  # the protected first message (system + task): never deleted
    ASSISTANT = "assistant"  # a reply of the model
    ENV = "env"  # the environment's answer
    INSTRUCTION = "instruction"  # a compaction instruction (summary strategies)
    BRIDGE = "bridge"  # what the model wrote to carry state across a compaction


class Bridge(StrEnum):
    """How a strategy's bridge is asked for."""

    INSTRUCTION = "instruction"  # an instruction message asks the model to write it
    MARKER = "marker"  # the model writes the strategy's marker; what follows is the bridge


@dataclass(frozen=True)
class UnitView:
    """One live message of the context after the head."""

    kind: UnitKind
    length: int


@dataclass
class CompactionStrategy:
    name: ClassVar[str] = "base"
    #: None: no bridge; else how the model is asked to write one
    bridge: ClassVar[Bridge | None] = None

    #: named settings (``make_strategy(name, preset=...)``): "kvstreams" is the KV-streams authors'
    #: configuration of the strategy (their released TextWorld configs)
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    #: B, the token budget: compact when the live context plus the incoming message would exceed it.
    #: None: the environment's ``token_budget`` (its messages' typical size decides what a sensible B is)
    token_budget: int | None = None
    turn_budget: int = 0  # > 0: also compact every this many turns since the last compaction
    #: > 0: turn-triggered, compact when the context holds this many turns (a turn: a reply and the
    #: environment's answer to it) ...
    max_turns: int = 0
    #: ... deleting this many of the oldest turns (0: the strategy's own rule decides what goes)
    drop_turns: int = 0

    def __post_init__(self) -> None:
        if self.token_budget is not None and self.token_budget < 16:
            raise KVStreamsError(
                f"{self.name}: token_budget must be at least 16 tokens, got {self.token_budget}"
            )
        if self.turn_budget < 0 or self.max_turns < 0 or self.drop_turns < 0:
            raise KVStreamsError(f"{self.name}: turn_budget, max_turns and drop_turns must be >= 0")
        if self.drop_turns and not 0 < self.drop_turns < self.max_turns:
            raise KVStreamsError(
                f"{self.name}: drop_turns ({self.drop_turns}) needs max_turns above it (got {self.max_turns})"
            )

    def with_token_budget(self, token_budget: int) -> CompactionStrategy:
        """This strategy with ``token_budget`` filled in when it was left to the environment."""
        if self.token_budget is not None:
            return self
        return dataclasses.replace(self, token_budget=token_budget)

    @property
    def token_budget_in_force(self) -> int:
        """The token budget B in force (``token_budget``, or the environment's once
        :meth:`with_token_budget` ran)."""
        if self.token_budget is None:
            raise KVStreamsError(f"{self.name}: no token_budget set (use with_token_budget)")
        return self.token_budget

    @property
    def when(self) -> Trigger:
        """When to compact: the trigger these fields configure."""
        return Trigger(self.token_budget_in_force, self.turn_budget, self.max_turns)

    def deletion(self, head: int, units: list[UnitView], incoming: int, reason: Reason) -> int:
        """How many of the oldest live units after the head go: the oldest ``drop_turns`` turns when a
        turn trigger fired and ``drop_turns`` is set, else the strategy's own :meth:`units_to_delete`."""
        if reason == Reason.TURNS and self.drop_turns:
            return units_of_oldest_turns(units, self.drop_turns)
        return self.units_to_delete(head, units, incoming)

    def units_to_delete(self, head: int, units: list[UnitView], incoming: int) -> int:
        """How many of the oldest live units after the head (``head`` tokens) to delete to make room for
        ``incoming`` tokens; the newest unit is always kept. Bridge strategies are given the units
        before the bridge."""
        raise NotImplementedError

    # --- the bridge protocol (strategies with ``bridge`` set override what they use) ---------------
    def bridge_request(self) -> str:
        """:attr:`Bridge.INSTRUCTION`: the message asking the model to write its bridge."""
        raise KVStreamsError(f"{self.name}: no bridge instruction (bridge is {self.bridge})")

    def bridge_marker(self) -> str:
        """:attr:`Bridge.MARKER`: the text after which the model's reply is the bridge."""
        raise KVStreamsError(f"{self.name}: no bridge marker (bridge is {self.bridge})")

    def bridge_limit(self, max_reply_tokens: int) -> int:
        """The most tokens a bridge may take (a reply's limit unless the strategy sets its own)."""
        return max_reply_tokens

    def min_retained(self, head: int) -> int:
        """The least a compaction can keep (head + what the strategy always keeps): must stay < the token budget."""
        return head

    def check(self, head: int) -> None:
        r = self.min_retained(head)
        if r >= self.token_budget_in_force:
            raise KVStreamsError(
                f"{self.name}: retained context r = {r} tokens (head {head} + what the strategy keeps) is not "
                f"below the budget B = {self.token_budget_in_force}; re-prefill cost N*r/(B-r) would diverge and compaction "
                "could never make room. Raise token_budget or keep less."
            )

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, **dataclasses.asdict(self)}


def units_of_oldest_turns(units: list[UnitView], turns: int) -> int:
    """How many of the oldest units hold the oldest ``turns`` turns: everything before the reply
    that starts turn ``turns + 1`` (earlier bridges included). The newest unit always stays."""
    replies = 0
    for i, unit in enumerate(units):
        if unit.kind == UnitKind.ASSISTANT:
            replies += 1
            if replies > turns:
                return i
    return max(0, len(units) - 1)


def live_turns(units: list[UnitView]) -> int:
    return sum(u.kind == UnitKind.ASSISTANT for u in units)


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
    return _REGISTRY.make(name, **{**options, **renamed_options(kwargs, warn=True)})


def renamed_options(options: dict[str, Any], warn: bool = False) -> dict[str, Any]:
    """A strategy's options under today's names: ``budget`` (B's name before "budget" came to mean a
    policy's KV budget only) read as ``token_budget``, with a warning where the user wrote it (strategy
    options, configs); without one for configs stored in checkpoints."""
    if "budget" not in options:
        return options
    if warn:
        warnings.warn(
            f"compaction strategy option 'budget' is now 'token_budget' (B); 'budget' = {options['budget']} "
            "is read as token_budget",
            FutureWarning,
            stacklevel=3,
        )
    return {"token_budget": options["budget"], **{k: v for k, v in options.items() if k != "budget"}}

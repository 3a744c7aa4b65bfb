"""Memory: facts revealed in the first turn are asked for at the end, many turns later.

The KV-streams paper's "pseudo-recurrent" setting. The facts arrive in the first observation, not
in the protected head, so compaction deletes them; only an agent that carries them forward in its
own replies (or summaries) can still answer. Each reply should be
``<state>...</state><action>...</action>``; the final question is answered inside ``<action>``.

Knobs: ``n_facts`` (how much to remember), ``n_turns`` (distractor turns before the question),
``noise_words`` (length of each distractor observation), ``kinds`` (which facts, e.g. ``["number"]``:
a two-digit number a guess gets right 1 time in 90, where a colour pays 1 in 6; default the first
``n_facts`` of color, room, name, code, number). Reward: the fraction of facts answered
correctly, given at the end. ``expert_reply`` carries the facts in every reply, so its demonstrations
teach exactly that habit; with ``expert_carries_state = False`` its states are empty and only its final
answer is right (read from the full context): demonstrations of the output format alone, for the
experiment where RL must discover the habit (``configs/experiments/recurrence-from-rl.toml``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import ClassVar

from kvstreams.envs.base import Environment, Message, StepResult, parse_action, register
from kvstreams.errors import KVStreamsError
from kvstreams.words import WORDS

FACT_KINDS = ("color", "room", "name", "code", "number")  # easiest first: n_facts=1 asks for a color
COLORS = ("red", "blue", "green", "yellow", "black", "white")
ROOMS = ("kitchen", "garden", "hall", "north", "south", "east")
NAMES = ("apple", "book", "lamp", "coin", "map", "note")


@register("memory")
@dataclass
class MemoryEnv(Environment):
    context_budget: ClassVar[int] = 384

    n_facts: int = 2
    n_turns: int = 10
    noise_words: int = 24
    max_turns: int = 32
    expert_carries_state: bool = True
    kinds: list[str] | None = None  # which facts, e.g. ["number"]; default: the first n_facts kinds
    _facts: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _turn: int = field(default=0, init=False, repr=False)
    _rng: random.Random = field(default_factory=random.Random, init=False, repr=False)

    def __post_init__(self) -> None:
        self.require_at_least(n_facts=1, n_turns=1, noise_words=0, max_turns=1)
        if self.kinds is not None:
            unknown = [k for k in self.kinds if k not in FACT_KINDS]
            if unknown or not self.kinds or len(set(self.kinds)) != len(self.kinds):
                raise KVStreamsError(
                    f"environment 'memory': kinds must be distinct names of {', '.join(FACT_KINDS)}, "
                    f"got {self.kinds}"
                )

    def _fact_value(self, kind: str) -> str:
        if kind == "code":
            return str(self._rng.randint(1000, 9999))
        if kind == "number":
            return str(self._rng.randint(10, 99))
        return self._rng.choice({"color": COLORS, "room": ROOMS, "name": NAMES}[kind])

    @property
    def facts(self) -> dict[str, str]:
        """The facts of the current episode (kind -> value)."""
        return dict(self._facts)

    def state_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self._facts.items())

    def reset(self, seed: int) -> list[Message]:
        self._rng = random.Random(seed)
        kinds = self.kinds or FACT_KINDS[: max(1, min(self.n_facts, len(FACT_KINDS)))]
        self._facts = {k: self._fact_value(k) for k in kinds}
        self._turn = 0
        return [
            {
                "role": "system",
                "content": "You are an agent with a short memory. Reply with <state>what you "
                "must remember</state><action>your action</action>.",
            },
            {
                "role": "user",
                "content": "You will be told facts. Remember them: you will be asked later. Ready?",
            },
        ]

    def _observation(self) -> str:
        if self._turn == 1:
            facts = ". ".join(f"the {k} is {v}" for k, v in self._facts.items())
            return f"Remember: {facts}. Reply <action>ok</action>."
        if self._turn >= self.n_turns:
            keys = " ".join(self._facts)
            return f"Final question: what is the {keys}? Answer <action>{' '.join(k + '=?' for k in self._facts)}</action>."
        noise = " ".join(self._rng.choice(WORDS) for _ in range(self.noise_words))
        return f"Turn {self._turn}. {noise}. Reply <action>ok</action>."

    def step(self, reply: str) -> StepResult:
        if self._turn >= self.n_turns:  # this reply answers the final question
            answer = parse_action(reply) or ""
            given = dict(re.findall(r"(\w+)\s*=\s*(\w+)", answer))
            correct = sum(given.get(k) == v for k, v in self._facts.items())
            return StepResult(
                [], correct / len(self._facts), True, {"correct": correct, "facts": len(self._facts)}
            )
        self._turn += 1
        return StepResult([{"role": "user", "content": self._observation()}], 0.0, False, {})

    def expert_reply(self) -> str:
        if self._turn == 0:  # nothing to remember yet
            return "<state></state><action>ok</action>"
        state = self.state_text() if self.expert_carries_state else ""
        if self._turn >= self.n_turns:
            return f"<state>{state}</state><action>{self.state_text()}</action>"
        return f"<state>{state}</state><action>ok</action>"

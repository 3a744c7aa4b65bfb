"""Memory: facts revealed in the first turn are asked for at the end, many turns later.

The KV-streams paper's "pseudo-recurrent" setting. The facts arrive in the first observation, not
in the protected head, so compaction deletes them; only an agent that carries them forward in its
own replies (or summaries) can still answer. Each reply should be
``<state>...</state><action>...</action>``; the final question is answered inside ``<action>``.

Besides the reward, the final step reports ``carried``: whether the ``<state>`` of the agent's last
reply before the question held every fact's value (what survives a compaction that deletes the
fact's observation; logged as ``env/carried`` in training and ``eval/env/carried`` in evaluation).

Knobs: ``n_facts`` (how much to remember), ``n_turns`` (the question's turn), ``fact_turn`` (the
facts' turn, default 1: the distractor turns are the others before the question; a later
``fact_turn`` shortens the gap to carry, a curriculum's easier stage; ``fact_turns``, a list, draws
it per episode, for demonstrations that do not tie the facts to one turn),
``noise_words`` (length of each distractor observation), ``kinds`` (which facts, e.g. ``["number"]``:
a two-digit number a guess gets right 1 time in 90, where a colour pays 1 in 6; default the first
``n_facts`` of color, room, name, code, number). Reward: the fraction of facts answered
correctly, given at the end. ``expert_reply`` carries the facts in every reply, so its demonstrations
teach exactly that habit; with ``expert_carries_state = False`` its states are empty and only its final
answer is right (read from the full context): demonstrations of the output format alone, for the
experiment where RL must discover the habit (``configs/experiments/recurrence-from-rl.toml``).
``expert_copy_rate`` (with ``expert_carries_state = False``) makes the habit discoverable without
showing it: the expert's state is one word copied from an observation; at each turn, with this
probability, a random word of the newest observation replaces it, otherwise the previous state is
restated. The fact is in that state only by chance (it is one word of its observation, and a later
copy overwrites it), so the demonstrations never tie carrying the fact to the reward
(``configs/experiments/recurrence-discoverable.toml``).
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
    token_budget: ClassVar[int] = 384

    n_facts: int = 2
    n_turns: int = 10
    fact_turn: int = 1  # the observation stating the facts; 1 <= fact_turn < n_turns
    fact_turns: list[int] | None = None  # if set: each episode's fact_turn, drawn from these
    noise_words: int = 24
    max_turns: int = 32
    expert_carries_state: bool = True
    kinds: list[str] | None = None  # which facts, e.g. ["number"]; default: the first n_facts kinds
    expert_copy_rate: float = 0.0  # > 0: the expert's state is a copied word (see the module docstring)
    _facts: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _turn: int = field(default=0, init=False, repr=False)
    _rng: random.Random = field(default_factory=random.Random, init=False, repr=False)
    _copy_rng: random.Random = field(default_factory=random.Random, init=False, repr=False)
    _copied: str = field(default="", init=False, repr=False)
    _carried: bool = field(default=False, init=False, repr=False)
    _fact_at: int = field(default=1, init=False, repr=False)

    def __post_init__(self) -> None:
        self.require_at_least(n_facts=1, n_turns=1, noise_words=0, max_turns=1)
        for turn in [self.fact_turn, *(self.fact_turns or [])]:
            if turn < 1 or (self.n_turns > 1 and turn >= self.n_turns):
                raise KVStreamsError(
                    f"environment 'memory': a fact_turn ({turn}) must be a turn before the question "
                    f"(1 to {self.n_turns - 1}; n_turns = {self.n_turns})"
                )
        if self.fact_turns is not None and not self.fact_turns:
            raise KVStreamsError("environment 'memory': fact_turns must name at least one turn")
        if not 0.0 <= self.expert_copy_rate <= 1.0:
            raise KVStreamsError(
                f"environment 'memory': expert_copy_rate must be in [0, 1], got {self.expert_copy_rate}"
            )
        if self.expert_copy_rate > 0 and self.expert_carries_state:
            raise KVStreamsError(
                "environment 'memory': expert_copy_rate needs expert_carries_state = false "
                "(an expert that carries the facts copies nothing at random)"
            )
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
        self._copy_rng = random.Random(f"copy-{seed}")  # its own stream: noise and facts stay as they were
        self._copied = ""
        self._fact_at = self.fact_turn
        if self.fact_turns:  # its own stream too
            self._fact_at = random.Random(f"fact-turn-{seed}").choice(self.fact_turns)
        self._carried = False
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
        if self._turn == self._fact_at:
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
            info = {"correct": correct, "facts": len(self._facts), "carried": self._carried}
            return StepResult([], correct / len(self._facts), True, info)
        if self._turn == self.n_turns - 1:  # the last reply before the question
            state = set(_plain_words(parse_state(reply)))
            self._carried = all(v in state for v in self._facts.values())
        self._turn += 1
        observation = self._observation()
        if self.expert_copy_rate > 0 and self._copy_rng.random() < self.expert_copy_rate:
            self._copied = self._copy_rng.choice(_plain_words(observation))
        return StepResult([{"role": "user", "content": observation}], 0.0, False, {})

    def expert_reply(self) -> str:
        if self._turn == 0:  # nothing to remember yet
            return "<state></state><action>ok</action>"
        known = self._turn >= self._fact_at  # the facts are stated at their turn, not before
        state = (self.state_text() if known else "") if self.expert_carries_state else self._copied
        if self._turn >= self.n_turns:
            return f"<state>{state}</state><action>{self.state_text()}</action>"
        return f"<state>{state}</state><action>ok</action>"


def parse_state(reply: str) -> str:
    """The text inside the reply's first ``<state>...</state>`` ("" without one)."""
    m = re.search(r"<state>(.*?)</state>", reply, re.S)
    return m.group(1) if m else ""


def _plain_words(text: str) -> list[str]:
    """The words of an observation a copying expert may pick (markup and punctuation left out)."""
    return re.findall(r"[A-Za-z0-9]+", re.sub(r"<[^>]*>", " ", text))

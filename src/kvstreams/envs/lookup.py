"""Lookup: key-value pairs, filler, then a question about some of the keys (single turn).

Rung 2 and 3 of the RL sanity ladder (``kvstreams experiment rl-sanity``): a task a tiny model can
learn, with partial credit and without lucky guesses, whose answer depends on the prompt (so what a
KV compression policy drops matters). The prompt states ``n_pairs`` pairs ``KEY is NN`` (distinct
keys, two-digit values), then ``filler`` noise words, then asks for ``n_asked`` of the keys::

    Remember: lamp is 42. coin is 17. map is 88. book is 51. <filler>. What are coin and book?
    Answer as key=value.

Reward: the asked keys whose first value in the reply is right (``coin=17``), divided by the number of
keys asked or, if more, of distinct keys the reply names (listing every pair is not an answer); a guess is right with
probability 1/90 per key, so the reward pays the skill, not luck. It is associative recall, the
"multi-query associative recall" probe of Arora et al. (2023, "Zoology", Sec. 3) with words for
tokens, cut down to a CPU-sized prompt; per-key credit follows the issue's advice that tasks with
partial credit learn faster than all-or-nothing ones.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import ClassVar

from kvstreams.envs.base import Environment, Message, StepResult, register
from kvstreams.errors import KVStreamsError
from kvstreams.words import WORDS

KEYS = ("apple", "book", "lamp", "coin", "map", "note", "key", "door", "box", "table", "chest", "room")
_PAIR = re.compile(r"([a-z]+)\s*=\s*(\d+)")


@register("lookup")
@dataclass
class LookupEnv(Environment):
    single_turn: ClassVar[bool] = True

    n_pairs: int = 4
    n_asked: int = 2
    filler: int = 0
    max_turns: int = 1
    _pairs: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _asked: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.require_at_least(n_pairs=1, n_asked=1, filler=0)
        if self.n_pairs > len(KEYS):
            raise KVStreamsError(f"environment 'lookup': n_pairs must be <= {len(KEYS)}, got {self.n_pairs}")
        if self.n_asked > self.n_pairs:
            raise KVStreamsError(
                f"environment 'lookup': n_asked ({self.n_asked}) must be <= n_pairs ({self.n_pairs})"
            )

    def reset(self, seed: int) -> list[Message]:
        rng = random.Random(seed)
        keys = rng.sample(KEYS, self.n_pairs)
        self._pairs = {k: str(rng.randint(10, 99)) for k in keys}
        self._asked = rng.sample(keys, self.n_asked)
        pairs = " ".join(f"{k} is {v}." for k, v in self._pairs.items())
        noise = " ".join(rng.choice(WORDS) for _ in range(self.filler))
        noise = f" {noise}." if noise else ""
        question = " and ".join(self._asked)
        text = f"Remember: {pairs}{noise} What {'is' if self.n_asked == 1 else 'are'} {question}? Answer as key=value."
        return [{"role": "user", "content": text}]

    def step(self, reply: str) -> StepResult:
        given: dict[str, str] = {}
        for key, value in _PAIR.findall(reply):
            given.setdefault(key, value)  # a key's first value counts
        correct = sum(given.get(k) == self._pairs[k] for k in self._asked)
        # naming keys that were not asked dilutes the credit: copying every pair is not an answer
        named = max(len(self._asked), len(given))
        return StepResult([], correct / named, True, {"correct": correct, "asked": len(self._asked)})

    def expert_reply(self) -> str:
        return " ".join(f"{k}={self._pairs[k]}" for k in self._asked)

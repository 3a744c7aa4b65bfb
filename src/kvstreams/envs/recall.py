"""Recall: a fact stated early, a question at the end (single turn).

The smallest task on which KV compression removes information the policy needs: the prompt states a
four-digit code, then ``n_filler`` sentences of unrelated text, then asks for the code. A pretrained
instruct model answers it at full KV (SmolLM2-135M-Instruct: ``docs/real-model.md``); a policy that
keeps only recent entries loses it; one that keeps what the question attends to
(SnapKV's observation window) can keep it. It is the needle-in-a-haystack probe of the
KV-compression literature (Li et al., 2024, SnapKV, Sec. 4) cut down to a CPU-sized prompt, and the
shape of the SMD paper's premise: compression drops context, the dense learner then scores replies
under context the sampler never had.

Reward 1 when the reply's first four-digit number is the code. Defaults: 16 filler sentences
(prompts of about 200 tokens with SmolLM2's chat template).

``n_codes > 1`` is the long-reply variant: ``n_codes`` numbered codes, each followed by
``n_filler`` filler sentences, and the reply must list every one ("code 1 is 4821. code 2 is ...",
about 13 tokens a code with the tiny models' tokenizer: 10 codes make a reply of ~130 tokens). The
reward is the share of codes given at their place in the reply (partial credit per fact, as the
RL-learns issue suggests for tasks with headroom). The reply's correctness depends on the prompt until
its last token, so what a KV policy drops *while decoding* (SnapKV's rounds every ``interval``
decode steps) matters, where the one-code task's 15-token reply is over before a round fires: the
setting SMD's long rollouts have and ``smd-table`` lacks.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import ClassVar

from kvstreams.envs.base import Environment, Message, StepResult, register

FILLER = (
    "The weather in the valley was mild that spring.",
    "Farmers brought their goods to the market every Tuesday.",
    "A small river ran past the old mill.",
    "The library opened at nine in the morning.",
    "Children played near the fountain in the square.",
    "The baker sold bread, rolls and cakes.",
    "A train left the station twice a day.",
    "The museum displayed paintings from many centuries.",
    "Tourists often visited the castle on the hill.",
    "The town council met on the first Monday of each month.",
)
_CODE = re.compile(r"\d{4}")


@register("recall")
@dataclass
class RecallEnv(Environment):
    token_budget: ClassVar[int] = 512
    single_turn: ClassVar[bool] = True

    n_filler: int = 16
    n_codes: int = 1
    max_turns: int = 1
    _code: int = field(default=0, init=False, repr=False)
    _codes: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.require_at_least(n_filler=0, n_codes=1)

    def reset(self, seed: int) -> list[Message]:
        rng = random.Random(seed)
        if self.n_codes > 1:
            return self._reset_many(rng)
        self._code = rng.randrange(1000, 10000)
        filler = " ".join(rng.choice(FILLER) for _ in range(self.n_filler))
        text = (
            f"Remember this: the secret code is {self._code}. {filler} "
            "What is the secret code? Answer with the number only."
        )
        return [{"role": "user", "content": text}]

    def _reset_many(self, rng: random.Random) -> list[Message]:
        self._codes = [rng.randrange(1000, 10000) for _ in range(self.n_codes)]
        parts = ["Remember these codes."]
        for i, code in enumerate(self._codes, 1):
            parts.append(f"code {i} is {code}.")
            parts.extend(rng.choice(FILLER) for _ in range(self.n_filler))
        parts.append("What are the codes? List every code in order.")
        return [{"role": "user", "content": " ".join(parts)}]

    def step(self, reply: str) -> StepResult:
        if self.n_codes > 1:  # the share of codes given at their place
            got = [int(x) for x in _CODE.findall(reply)]
            right = sum(g == c for g, c in zip(got, self._codes, strict=False))
            return StepResult([], right / self.n_codes, True, {"expected": self._codes, "got": got})
        found = _CODE.search(reply)
        got = int(found.group()) if found else None
        return StepResult([], float(got == self._code), True, {"expected": self._code, "got": got})

    def expert_reply(self) -> str:
        if self.n_codes > 1:
            return " ".join(f"code {i} is {c}." for i, c in enumerate(self._codes, 1))
        return f"The secret code is {self._code}."

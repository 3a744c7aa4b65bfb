"""GSM8K: single-turn grade-school math with a long reasoning budget.

Cobbe et al., 2021. Reads a local JSONL file of ``{"question", "answer"}`` records whose answers end
with ``#### N`` (the official format); nothing is downloaded. The reply is scored by exact numeric
match of its final answer: the number after the last ``####``, else the last number in the reply.
Used with the compression policies (the Shadow Mask Distillation paper's GSM8K setting).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kvstreams.envs.base import Environment, Message, StepResult, register
from kvstreams.errors import KVStreamsError

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a solution or reply, normalised ("1,000.0" -> "1000")."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    value = numbers[0] if "####" in text else numbers[-1]
    value = value.replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


@register("gsm8k")
@dataclass
class GSM8KEnv(Environment):
    context_budget: ClassVar[int] = 1024

    path: str = "../shared/data/gsm8k/test.jsonl"
    max_turns: int = 1
    _rows: list[dict] = field(default_factory=list, init=False, repr=False)
    _current: dict = field(default_factory=dict, init=False, repr=False)

    def _load(self) -> None:
        if self._rows:
            return
        path = Path(self.path)
        if not path.is_file():
            raise KVStreamsError(
                f"gsm8k: data file {str(path)!r} not found (pass path=... to the environment)"
            )
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append({"question": row["question"], "answer": row["answer"]})
            except (json.JSONDecodeError, KeyError, TypeError):
                raise KVStreamsError(f"gsm8k: {path}:{n} is not a {{question, answer}} JSON record") from None
        if not rows:
            raise KVStreamsError(f"gsm8k: {path} holds no records")
        self._rows = rows

    def reset(self, seed: int) -> list[Message]:
        self._load()
        self._current = self._rows[random.Random(seed).randrange(len(self._rows))]
        return [
            {
                "role": "system",
                "content": "Solve the problem. Think step by step, then end with #### <number>.",
            },
            {"role": "user", "content": self._current["question"]},
        ]

    def step(self, reply: str) -> StepResult:
        expected = extract_answer(self._current["answer"])
        got = extract_answer(reply)
        return StepResult(
            [], float(got is not None and got == expected), True, {"expected": expected, "got": got}
        )

    def expert_reply(self) -> str:
        return self._current["answer"]

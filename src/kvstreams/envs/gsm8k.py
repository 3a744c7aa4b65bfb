"""GSM8K: single-turn grade-school math with a long reasoning budget.

Cobbe et al., 2021. Reads local JSONL files of ``{"question", "answer"}`` records whose answers end
with ``#### N`` (the official format; the train and test splits in ``../shared/data/gsm8k/``);
nothing is downloaded. The reply is scored by exact numeric
match of its final answer: the number after the last ``####``, else the last number in the reply.
Used with the compression policies (the Shadow Mask Distillation paper's GSM8K setting).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
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


@lru_cache(maxsize=8)
def load_problems(path: str) -> tuple[dict[str, str], ...]:
    """The ``{question, answer}`` records of a local JSONL file (read once per process)."""
    file = Path(path)
    if not file.is_file():
        raise KVStreamsError(
            f"gsm8k: data file {path!r} not found (pass path=... / eval_path=... to the environment)"
        )
    rows = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append({"question": str(row["question"]), "answer": str(row["answer"])})
        except (json.JSONDecodeError, KeyError, TypeError):
            raise KVStreamsError(f"gsm8k: {path}:{n} is not a {{question, answer}} JSON record") from None
    if not rows:
        raise KVStreamsError(f"gsm8k: {path} holds no records")
    return tuple(rows)


def shuffled(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


@register("gsm8k")
@dataclass
class GSM8KEnv(Environment):
    """Training draws from ``path`` (the train split), evaluation from ``eval_path`` (the test split):
    :meth:`held_out` is this environment on the test split. Task ``seed`` is the ``seed``-th problem
    of a fixed shuffle, so consecutive seeds give distinct problems.

    ``shots`` > 0 puts that many solved train problems before the question, in lm-evaluation-harness'
    gsm8k format ("Question: ...\nAnswer: <solution> #### N", blank line between): SMD evaluates GSM8K
    8-shot (seed 003, Sec. 4.2, after Brown et al., 2020). Where we differ from the harness: the same
    exemplars (the first ``shots`` of a fixed shuffle of the train split, left out of the training
    tasks) for every problem, rather than a fresh draw per problem.
    """

    token_budget: ClassVar[int] = 1024
    single_turn: ClassVar[bool] = True

    path: str = "../shared/data/gsm8k/train.jsonl"
    eval_path: str = "../shared/data/gsm8k/test.jsonl"
    shots: int = 0
    max_turns: int = 1
    evaluating: bool = False
    _current: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.require_at_least(shots=0)

    def held_out(self) -> GSM8KEnv:
        return dataclasses.replace(self, evaluating=True)

    def _tasks(self) -> tuple[tuple[dict[str, str], ...], list[int]]:
        if self.evaluating:
            rows = load_problems(self.eval_path)
            return rows, shuffled(len(rows), 0)
        rows = load_problems(self.path)
        order = shuffled(len(rows), 0)
        if self.shots >= len(order):
            raise KVStreamsError(f"gsm8k: {self.shots} shots leave no training problem in {self.path}")
        return rows, order[self.shots :]  # the exemplars are never training tasks

    def exemplars(self) -> str:
        """The few-shot block ("" without shots)."""
        if not self.shots:
            return ""
        rows = load_problems(self.path)
        picked = [rows[i] for i in shuffled(len(rows), 0)[: self.shots]]
        return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in picked)

    def reset(self, seed: int) -> list[Message]:
        rows, order = self._tasks()
        self._current = rows[order[seed % len(order)]]
        question = self._current["question"]
        user = f"{self.exemplars()}Question: {question}\nAnswer:" if self.shots else question
        return [
            {
                "role": "system",
                "content": "Solve the problem. Think step by step, then end with #### <number>.",
            },
            {"role": "user", "content": user},
        ]

    def step(self, reply: str) -> StepResult:
        expected = extract_answer(self._current["answer"])
        got = extract_answer(reply)
        return StepResult(
            [], float(got is not None and got == expected), True, {"expected": expected, "got": got}
        )

    def expert_reply(self) -> str:
        return self._current["answer"]

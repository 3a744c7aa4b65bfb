"""Bandit: one choice pays (single turn). Rung 1 of the RL sanity ladder (``kvstreams experiment rl-sanity``).

The prompt asks for a few words; the reward is 1 when the reply contains ``target`` (default: the
letter ``z``), else 0. Nothing in the prompt says so: the policy can only find the rewarded choice
by trying, which is what makes it a test of the RL loop rather than of the warm start. A fresh tiny
model writes ``z`` in a minority of its replies; a working GRPO loop raises that share to nearly 1 in
a few steps, and each classic bug (advantage sign flipped, advantages zero, gradient cut from the
log-probs, optimizer not stepping) keeps it where it started or drives it down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstreams.envs.base import Environment, Message, StepResult, register
from kvstreams.errors import KVStreamsError


@register("bandit")
@dataclass
class BanditEnv(Environment):
    single_turn: ClassVar[bool] = True

    target: str = "z"
    max_turns: int = 1

    def __post_init__(self) -> None:
        if not self.target:
            raise KVStreamsError("environment 'bandit': target must be a non-empty string")

    def reset(self, seed: int) -> list[Message]:
        return [{"role": "user", "content": f"Task {seed % 1000}. Write a few words."}]

    def step(self, reply: str) -> StepResult:
        hit = self.target in reply
        return StepResult([], float(hit), True, {"hit": hit})

    def expert_reply(self) -> str:
        return f"{self.target}"

"""The environment interface and registry.

An environment speaks chat messages. ``reset(seed)`` returns the opening messages (system + task:
the protected head of the context); ``step(reply)`` takes the model's reply text and returns
``(observation messages, reward, done, info)``. Rewards of an episode sum to a number in [0, 1].
Adding an environment is one file::

    @register("my_env")
    @dataclass
    class MyEnv(Environment):
        '''What the agent must do.'''
        def reset(self, seed): ...
        def step(self, reply): ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from kvstreams.errors import KVStreamsError
from kvstreams.registry import Registry

Message = dict[str, str]


class StepResult(NamedTuple):
    messages: list[Message]
    reward: float
    done: bool
    info: dict[str, Any]


@dataclass
class Environment:
    name: ClassVar[str] = "base"
    #: default compaction budget B in tokens, sized to this environment's messages
    context_budget: ClassVar[int] = 512
    #: one prompt, one reply (sampled by the rollout engine with a KV compression policy, no compaction)
    single_turn: ClassVar[bool] = False
    #: the most replies an episode may take before it is cut off (reward 0 for what is missing)
    max_turns: int = 32

    def reset(self, seed: int) -> list[Message]:
        raise NotImplementedError

    def require_at_least(self, **limits: int) -> None:
        """Option checks for ``__post_init__``: a bad value is one clear line before any rollout."""
        for option, low in limits.items():
            value = getattr(self, option)
            if value < low:
                raise KVStreamsError(f"environment {self.name!r}: {option} must be >= {low}, got {value}")

    def step(self, reply: str) -> StepResult:
        raise NotImplementedError

    def held_out(self) -> Environment:
        """This environment for evaluation. Environments that generate tasks from seeds hold tasks out
        by seed (training seeds stay below ``train.eval_seed``) and return themselves; datasets with a
        test split return the environment on that split."""
        return self

    def expert_reply(self) -> str:
        """What an expert would reply now (for demonstrations); environments without one raise."""
        raise NotImplementedError(f"environment {self.name!r} has no expert")

    def close(self) -> None:
        return None


_REGISTRY: Registry[Environment] = Registry("environment")
ENVIRONMENTS = _REGISTRY.entries
register = _REGISTRY.register


def make_env(name: str, **kwargs: Any) -> Environment:
    return _REGISTRY.make(name, **kwargs)


def is_single_turn(name: str) -> bool:
    """True for registered single-turn environments (unknown names: False, the registry reports them)."""
    cls = ENVIRONMENTS.get(name)
    return bool(cls is not None and cls.single_turn)


_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)


def parse_action(reply: str) -> str | None:
    """The text inside the last ``<action>...</action>`` of a reply, or None."""
    found = _ACTION.findall(reply)
    return found[-1].strip() if found else None

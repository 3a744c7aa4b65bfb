"""The environment interface and registry.

An environment speaks chat messages. ``reset(seed)`` returns the opening messages (system + task:
the protected head of the context); ``step(reply)`` takes the model's reply text and returns
``(observation messages, reward, done, info)``. Rewards of an episode sum to a number in
``reward_range`` ([0, 1] by default). What an environment returns is checked (:func:`checked_messages`,
:func:`checked_reward`): an episode whose environment returns something else is dropped and counted
like one whose environment raised, never trained or evaluated on.
Adding an environment is one file::

    @register("my_env")
    @dataclass
    class MyEnv(Environment):
        '''What the agent must do.'''
        def reset(self, seed): ...
        def step(self, reply): ...
"""

from __future__ import annotations

import math
import numbers
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
    token_budget: ClassVar[int] = 512
    #: one prompt, one reply (sampled by the rollout engine with a KV compression policy, no compaction)
    single_turn: ClassVar[bool] = False
    #: the range an episode's rewards must sum to (an episode outside it is dropped, not trained on)
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
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


class EnvironmentOutputError(ValueError):
    """An environment returned something outside its interface (its episode is dropped)."""


def checked_messages(messages: Any, what: str) -> list[Message]:
    """``messages`` if it is a list of chat messages (dicts with string ``role`` and ``content``)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        shown = repr(messages)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise EnvironmentOutputError(
            f"{what} returned {shown}, not a list of messages with string 'role' and 'content'"
        )
    return messages


def checked_reward(reward: Any) -> float:
    """``reward`` as a float if it is a finite real number (bool, str, None, NaN and inf are not)."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise EnvironmentOutputError(f"step returned reward {reward!r}, not a number")
    value = float(reward)
    if not math.isfinite(value):
        raise EnvironmentOutputError(f"step returned reward {value}, not a finite number")
    return value


def check_episode_reward(env: Environment, total: float) -> None:
    low, high = env.reward_range
    if not low - 1e-9 <= total <= high + 1e-9:
        raise EnvironmentOutputError(
            f"the episode's rewards sum to {total:g}, outside the documented range [{low:g}, {high:g}]"
        )


def checked_step(env: Environment, result: Any, reward_so_far: float = 0.0) -> StepResult:
    """``env.step``'s ``result`` if it keeps the interface: a finite reward that leaves the episode's
    total in ``env.reward_range``, a list of messages when the episode goes on, an ``info`` dict."""
    messages, reward, done, info = result
    reward = checked_reward(reward)
    check_episode_reward(env, reward_so_far + reward)
    if not done:
        checked_messages(messages, "step")
    if not isinstance(info, dict):
        raise EnvironmentOutputError(f"step returned info {info!r}, not a dict")
    return StepResult(messages, reward, done, info)


def failure(err: Exception, action: str = "step") -> str:
    """How an environment's failure reads in a dropped episode's line."""
    if isinstance(err, EnvironmentOutputError):
        return str(err)
    return f"{action} raised {type(err).__name__}: {err}"


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

"""Environments: chat-message episodes for the rollout engine, registered by name."""

from kvstreams.envs import bandit, gsm8k, memory, recall, textworld_env  # noqa: F401  (registration)
from kvstreams.envs.base import (
    ENVIRONMENTS,
    Environment,
    Message,
    StepResult,
    is_single_turn,
    make_env,
    parse_action,
    register,
)

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "Message",
    "StepResult",
    "is_single_turn",
    "make_env",
    "parse_action",
    "register",
]

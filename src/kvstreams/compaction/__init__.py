"""Compaction strategies (the KV-streams paper's rollout side), one module each, registered by name.

Ordered by how much context they retain: sliding_window > markovian > summary ~ model_triggered.
"""

from kvstreams.compaction import markovian, model_triggered, sliding_window, summary  # noqa: F401
from kvstreams.compaction.base import (
    STRATEGIES,
    Bridge,
    CompactionStrategy,
    UnitKind,
    UnitView,
    live_turns,
    make_strategy,
    register,
)
from kvstreams.compaction.trigger import Reason, Trigger

__all__ = [
    "STRATEGIES",
    "Bridge",
    "CompactionStrategy",
    "Reason",
    "Trigger",
    "UnitKind",
    "UnitView",
    "live_turns",
    "make_strategy",
    "register",
]

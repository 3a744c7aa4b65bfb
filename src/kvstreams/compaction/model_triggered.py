"""Model-triggered: the model itself decides to compact by writing a marker; what follows is the bridge.

The KV-streams paper's learned compaction trigger. When a reply contains ``marker``, everything
between the head and the end of the marker is deleted and the rest of the reply (the bridge) stays.
As a safety net, if the live context would exceed ``budget`` the engine starts the next reply with
the marker itself (forced, not trained on) and the model writes the bridge.

Defaults: marker ``<compact>``, the environment's budget, bridges of at most 64 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstreams.compaction.base import Bridge, CompactionStrategy, UnitView, register
from kvstreams.errors import KVStreamsError


@register("model_triggered")
@dataclass
class ModelTriggered(CompactionStrategy):
    bridge: ClassVar[Bridge | None] = Bridge.MARKER

    marker: str = "<compact>"
    max_bridge_tokens: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.marker:
            raise KVStreamsError("model_triggered: marker must not be empty")

    def bridge_marker(self) -> str:
        return self.marker

    def bridge_limit(self, max_reply_tokens: int) -> int:
        return self.max_bridge_tokens

    def units_to_delete(self, head: int, units: list[UnitView], incoming: int) -> int:
        return len(units)  # everything before the marker

    def min_retained(self, head: int) -> int:
        return head + 1

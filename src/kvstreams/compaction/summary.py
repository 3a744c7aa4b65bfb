"""Summary: the model writes a bridge after an instruction; then the old span is deleted.

The KV-streams paper's summarisation compaction (kappa = gen o del with a generated bridge): when the
budget is reached, an instruction asks the model to summarise what it must remember; the model's
reply (the bridge: sampled and trained on like any reply) stays, and every message between the head
and the bridge, the instruction included, is deleted.

Defaults: the environment's budget, bridges of at most 64 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstreams.compaction.base import CompactionStrategy, register
from kvstreams.errors import KVStreamsError


@register("summary")
@dataclass
class Summary(CompactionStrategy):
    bridge: ClassVar[str | None] = "instruction"

    instruction: str = (
        "Context limit reached: the conversation so far will be deleted. Write a short summary of "
        "everything you must remember, as <state>...</state>."
    )
    max_bridge_tokens: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_bridge_tokens < 1:
            raise KVStreamsError(f"summary: max_bridge_tokens must be >= 1, got {self.max_bridge_tokens}")

    def min_retained(self, head: int) -> int:
        return head + 1

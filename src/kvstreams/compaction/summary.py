"""Summary: the model writes a bridge after an instruction; then the old span is deleted.

The KV-streams paper's summarisation compaction (kappa = gen o del with a generated bridge): when the
budget is reached, an instruction asks the model to summarise what it must remember; the model's
reply (the bridge: sampled and trained on like any reply) stays, and every message between the head
and the bridge, the instruction included, is deleted.

Defaults: the environment's budget, bridges of at most 64 tokens.

Preset ``kvstreams`` (``make_strategy(name, preset="kvstreams")``): the KV-streams authors'
configuration (when the context holds 8 turns (their `compaction_max_turns`), the 5 oldest turns are replaced by a summary of at most 1,024 tokens, the task instruction (the protected head) kept; their released ``configs/textworld/kv_streams_summary.toml``), with
a token budget of 32,768 (their ``seq_len``) so that turns alone decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvstreams.compaction.base import Bridge, CompactionStrategy, UnitView, register
from kvstreams.errors import KVStreamsError


@register("summary")
@dataclass
class Summary(CompactionStrategy):
    bridge: ClassVar[Bridge | None] = Bridge.INSTRUCTION
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "kvstreams": {"max_turns": 8, "drop_turns": 5, "max_bridge_tokens": 1024, "token_budget": 32768}
    }

    instruction: str = (
        "Context limit reached: the conversation so far will be deleted. Write a short summary of "
        "everything you must remember, as <state>...</state>."
    )
    max_bridge_tokens: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_bridge_tokens < 1:
            raise KVStreamsError(f"summary: max_bridge_tokens must be >= 1, got {self.max_bridge_tokens}")

    def bridge_request(self) -> str:
        return self.instruction

    def bridge_limit(self, max_reply_tokens: int) -> int:
        return self.max_bridge_tokens

    def units_to_delete(self, head: int, units: list[UnitView], incoming: int) -> int:
        return len(units)  # everything before the bridge

    def min_retained(self, head: int) -> int:
        return head + 1

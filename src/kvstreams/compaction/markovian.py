"""Markovian Thinker: keep the protected head and the last chunk; drop everything between.

Aghajohari et al., 2025, "The Markovian Thinker": the context is reset to the task plus a short
carry-over chunk, so memory is constant and the agent must carry state in what it writes. Deletes
in one large stride: everything but the newest ``keep_tokens`` worth of messages (at least the newest
message is kept).

Defaults: the environment's budget, keep_tokens a third of it.

Preset ``kvstreams`` (``make_strategy(name, preset="kvstreams")``): the KV-streams authors'
configuration (turn-triggered at 10 turns in the context, the oldest 5 dropped; their released ``configs/textworld/kv_streams_markovian_thinker.toml``), with
a token budget of 32,768 (their ``seq_len``) so that turns alone decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvstreams.compaction.base import CompactionStrategy, UnitView, register
from kvstreams.errors import KVStreamsError


@register("markovian")
@dataclass
class Markovian(CompactionStrategy):
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "kvstreams": {"max_turns": 10, "drop_turns": 5, "token_budget": 32768}
    }

    keep_tokens: int | None = None  # None: a third of the budget

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keep_tokens is not None and self.keep_tokens < 1:
            raise KVStreamsError(f"markovian: keep_tokens must be positive, got {self.keep_tokens}")
        if (
            self.keep_tokens is not None
            and self.token_budget is not None
            and self.keep_tokens >= self.token_budget
        ):
            raise KVStreamsError(
                f"markovian: keep_tokens ({self.keep_tokens}) must be below the token_budget ({self.token_budget}): "
                "retaining r >= B leaves no room to compact"
            )

    @property
    def keep(self) -> int:
        return self.keep_tokens if self.keep_tokens is not None else self.token_budget_in_force // 3

    def units_to_delete(self, head: int, units: list[UnitView], incoming: int) -> int:
        kept, n_keep = 0, 0
        for unit in reversed(units):
            if n_keep and kept + unit.length > self.keep:
                break
            kept += unit.length
            n_keep += 1
        return len(units) - n_keep

    def min_retained(self, head: int) -> int:
        return head + 1

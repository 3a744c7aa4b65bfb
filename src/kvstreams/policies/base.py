"""The eviction-policy interface and registry.

A policy answers one question for the engine: *which cached entries should stay?* The engine asks it
whenever a sequence's cache is full (``budget`` live entries, counting the token just written) and
keeps the ``budget - interval`` entries with the highest :meth:`EvictionPolicy.score` (entries the
policy marks :meth:`~EvictionPolicy.protected` are always kept). So ``interval`` is both how many
entries one eviction round frees and how many decode steps pass between rounds.

Scores are per layer and per KV head; the engine records every decision in the trace's ``death``
tensor, whatever the policy does. Adding a policy is one file::

    @register("my_policy")
    @dataclass
    class MyPolicy(EvictionPolicy):
        '''What it keeps, which paper, its defaults.'''
        def score(self, view: EntryView) -> torch.Tensor:
            return -view.index.float()   # e.g. keep the oldest entries
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvstreams.errors import KVStreamsError
from kvstreams.registry import Registry


@dataclass
class EntryView:
    """What a policy may look at when choosing: one layer's cached entries, per sequence and KV head.

    ``N`` is the number of candidate entries (cache slots during decode, prompt columns after
    prefill); their order carries no meaning, ``index`` says which trace token each one holds.
    """

    layer: int
    keys: torch.Tensor  # [B, H_kv, N, D], RoPE applied
    index: torch.Tensor  # [B, H_kv, N] trace index of each entry, -1 where the slot is empty
    query_index: torch.Tensor  # [B] trace index of the query that has just attended
    budget: torch.Tensor  # [B] the sequence's budget (entries per layer and KV head)
    attn_cumulative: torch.Tensor | None = None  # [B, H_kv, N] attention received by each entry so far
    attn_window: torch.Tensor | None = None  # [B, H_kv, N] attention received from the observation window
    generator: torch.Generator | None = None

    @property
    def live(self) -> torch.Tensor:
        return self.index >= 0


@dataclass
class EvictionPolicy:
    """Base class. ``budget``: an int is an absolute number of entries per layer and KV head; a float
    in (0, 1] is the share of entries kept, read per ``budget_of``:

    - ``"sequence"`` (default; SMD's "retaining only 50% of the KV tokens per sequence"): a round
      after the dense prefill and then every ``interval`` decode steps keeps ceil(share x the tokens
      the sequence holds so far), at least what the policy pins (:meth:`min_kept`);
    - ``"context"``: a fixed budget of share x (prompt + max new tokens) entries.

    SMD's compression ratios (20/50/70%) are shares *dropped*: ratio 20% is ``budget = 0.8``.
    """

    name: ClassVar[str] = "base"
    #: attention statistics the engine must track for this policy: "cumulative" and/or "window"
    needs: ClassVar[frozenset[str]] = frozenset()

    budget: float | int = 0.5
    interval: int = 1
    budget_of: str = "sequence"

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int | float):
            raise KVStreamsError(f"{self.name}: budget must be a number, got {self.budget!r}")
        if isinstance(self.budget, float) and not (0.0 < self.budget <= 1.0):
            raise KVStreamsError(
                f"{self.name}: a fractional budget must be in (0, 1], got {self.budget}; "
                "give an integer for an absolute number of entries"
            )
        if isinstance(self.budget, int) and self.budget < 2:
            raise KVStreamsError(f"{self.name}: budget must hold at least 2 entries, got {self.budget}")
        if self.interval < 1:
            raise KVStreamsError(f"{self.name}: interval must be >= 1, got {self.interval}")
        if self.budget_of not in ("sequence", "context"):
            raise KVStreamsError(
                f"{self.name}: budget_of must be 'sequence' or 'context', got {self.budget_of!r}"
            )

    # --- what subclasses implement -------------------------------------------------------------
    def score(self, view: EntryView) -> torch.Tensor:
        """[B, H_kv, N] float: higher means keep. Empty slots are ignored by the engine."""
        raise NotImplementedError

    def protected(self, view: EntryView) -> torch.Tensor | None:
        """[B, H_kv, N] bool of entries that must stay, or None."""
        return None

    def n_protected(self, budget: int) -> int:
        """How many entries :meth:`protected` may pin at most under ``budget`` (checked against it)."""
        return 0

    # --- shared ----------------------------------------------------------------------------------
    @property
    def window_size(self) -> int:
        """Observation window (queries) for policies that need "window" attention statistics."""
        return 0

    @property
    def per_sequence(self) -> bool:
        """True when the budget follows each sequence's length (a fractional budget, ``budget_of =
        "sequence"``)."""
        return isinstance(self.budget, float) and self.budget_of == "sequence" and self.evicts()

    def min_kept(self) -> int:
        """The least a per-sequence round keeps: what the policy pins whatever the budget (SnapKV's
        window, StreamingLLM's sinks), and never fewer than 2."""
        return max(2, self.n_protected(0))

    def kept_at(self, n_tokens: torch.Tensor) -> torch.Tensor:
        """Per-sequence budgets: entries a round keeps for sequences holding ``n_tokens`` [B] tokens."""
        share = torch.ceil(n_tokens.double() * float(self.budget) - 1e-9).long()
        return share.clamp(min=self.min_kept())

    def resolve_budget(self, context_len: int) -> int:
        """Entries per layer and KV head for a sequence whose full context is ``context_len`` tokens."""
        if isinstance(self.budget, float):
            budget = max(2, math.ceil(self.budget * context_len))
        else:
            budget = self.budget
        return budget

    def check_budget(self, budget: int) -> None:
        """Fail clearly when the budget cannot hold what the policy must keep after a round."""
        kept = budget - self.interval
        protected = self.n_protected(budget)
        if kept < max(1, protected):
            raise KVStreamsError(
                f"{self.name}: budget {budget} is too small: an eviction round keeps budget - interval = "
                f"{kept} entries but the policy protects {protected} (raise the budget or lower interval)"
            )

    def evicts(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, **dataclasses.asdict(self)}


_REGISTRY: Registry[EvictionPolicy] = Registry("policy")
POLICIES = _REGISTRY.entries
register = _REGISTRY.register


def parse_budget(text: str) -> float | int:
    """``"0.5"`` or ``"50%"`` -> 0.5 (fraction of context); ``"256"`` -> 256 entries."""
    raw = text.strip()
    try:
        if raw.endswith("%"):
            return float(raw[:-1]) / 100.0
        if any(c in raw for c in ".eE"):
            return float(raw)
        return int(raw)
    except ValueError:
        raise KVStreamsError(
            f"bad budget {text!r}: give a fraction like 0.5 or 50%, or a count like 256"
        ) from None


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """Build a registered policy by name; unknown names and fields are clear errors."""
    return _REGISTRY.make(name, **kwargs)


def sequence_order_pool(
    values: torch.Tensor, index: torch.Tensor, kernel: int, mode: str = "avg"
) -> torch.Tensor:
    """1-D pooling of per-entry values along *trace order* (entries sit in arbitrary cache slots).

    Empty entries (index < 0) contribute zeros and are placed after all live ones.
    """
    if kernel <= 1:
        return values
    big = torch.iinfo(index.dtype).max
    order = torch.where(index >= 0, index, torch.full_like(index, big)).argsort(dim=-1, stable=True)
    ordered = values.gather(-1, order)
    flat = ordered.reshape(-1, 1, ordered.shape[-1])
    pool = torch.nn.functional.avg_pool1d if mode == "avg" else torch.nn.functional.max_pool1d
    pooled = pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    pooled = pooled[..., : ordered.shape[-1]].reshape(ordered.shape)
    return torch.empty_like(pooled).scatter_(-1, order, pooled)

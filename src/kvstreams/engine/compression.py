"""Compression: when an eviction policy's rounds fire and how many entries they keep, in either kind of
:class:`~kvstreams.engine.stream.StreamSession` batch.

The policy only *scores* entries (:meth:`EvictionPolicy.score`, per layer and KV head);
:func:`choose_kept` keeps the best of them, and a schedule value says *when* a round fires and *how
many* entries it keeps -- the split kvpress makes between a press's ``score`` and its
``DecodingPress`` wrapper. Rounds run after a forward's attention, per layer, inside the forward (the
keys are at hand there, :mod:`kvstreams.engine.steps`); every entry a round drops gets its ``death`` =
the next query's index, the same record compaction writes, so the learner's replay is the same for
every source of eviction: a trace whose episode was both compressed and compacted is replayed
exactly like either alone.

There are two schedule values, one per kind of batch, and the session holds the one its batch needs:

- :class:`StepSchedule`, a single-turn batch (:meth:`StreamSession.for_prompts`): every context length
  (prompt + max new tokens) is known in advance, so budgets may be a share of it (``budget_of =
  "context"``) and size the cache. A share of the sequence (``budget_of = "sequence"``) fires a round
  after the dense prefill and then every ``interval`` decode steps, counted in steps; a fixed budget
  fires when a decode step's write fills the cache; SnapKV's window is the exact ``window_size``
  queries before the round (the last ones of the prompt at prefill).
- :class:`StreamBudget`, a multi-turn stream (rounds after each :meth:`StreamSession.forward`, whose
  chunks may be long):

  - A fixed budget (an entry count per layer and KV head): a round fires after any forward that
    leaves a row holding ``budget`` or more live entries and keeps ``budget - interval`` of them. A
    forward feeds a whole chunk at once (an observation, or a reply's tail): its queries attend to
    everything live plus the chunk, then the round drops the surplus -- the single-turn prefill's
    order, per chunk. So the KV held between forwards stays below ``budget``, and a chunk adds its
    length transiently.
  - A share (a float, ``budget_of = "sequence"``): a round fires once the live entries reach
    ``kept + interval``, where ``kept = ceil(share x tokens fed so far)``, and keeps ``kept``.
    ``budget_of = "context"`` has no meaning here (a multi-turn episode's length is not known in
    advance) and is refused.
  - SnapKV's observation window: the queries whose attention counts are the ``window_size`` queries
    before the round, *predicted* from the budget before each forward (a decode step cannot know
    whether a later chunk will trigger the round sooner). A chunk that overshoots the predicted round
    counts its own last ``window_size`` queries, plus any earlier ones already counted.

They are not one value because their rounds differ (a share's rounds counted in decode steps vs in
live entries; the window exact vs predicted; the prompt through a dense prefill vs through slots):
either one's rules applied to the other's batches would sample other traces, and the traces of
every existing setting are kept bit-for-bit (``tests/test_trace_hashes.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstreams.errors import KVStreamsError
from kvstreams.policies import EntryView, EvictionPolicy


def choose_kept(
    policy: EvictionPolicy, view: EntryView, target: torch.Tensor, evicting: torch.Tensor
) -> torch.Tensor:
    """[B, H, N] bool: the ``target[b]`` best live entries of every evicting sequence, all live ones else."""
    live = view.live
    score = policy.score(view).float()
    protected = policy.protected(view)
    if protected is not None:
        score = score.masked_fill(protected & live, float("inf"))
    score = score.masked_fill(~live, float("-inf"))
    order = score.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    keep = live & (rank < target[:, None, None])
    return torch.where(evicting[:, None, None], keep, live)


@dataclass
class DecodeRows:
    """Per-row state of a single-turn batch's sequences still being decoded (rows leave when they finish)."""

    seq: torch.Tensor  # [B] original sequence number
    query_index: torch.Tensor  # [B] trace index of the token fed at this step
    budget: torch.Tensor  # [B]
    target: torch.Tensor  # [B] entries kept by an eviction round
    n_live: torch.Tensor  # [B] live entries per (layer, head) before this step's write

    def select(self, rows: torch.Tensor) -> None:
        for name in ("seq", "query_index", "budget", "target", "n_live"):
            setattr(self, name, getattr(self, name).index_select(0, rows))


class StepSchedule:
    """When eviction rounds fire and how many entries they keep in a single-turn batch, per sequence.

    - A budget per sequence (a fractional budget, ``budget_of = "sequence"``, the default; SMD's
      "retaining only 50% of the KV tokens per sequence"): a round after the dense prefill and then
      every ``interval`` decode steps keeps ceil(share x the sequence's tokens so far) entries (at
      least what the policy pins), so a reply that stops early is compressed at the nominal share.
    - A fixed budget (an entry count, or a share of prompt + max new tokens with ``budget_of =
      "context"``): a round whenever the cache holds ``budget`` entries keeps ``budget - interval``.

    ``batch.budget`` is what policies see as the budget: the entries kept plus ``interval``.
    """

    def __init__(self, policy: EvictionPolicy, contexts: list[int], device) -> None:
        self.policy, self.device = policy, device
        self.per_sequence = policy.per_sequence
        if self.per_sequence:
            kept = policy.kept_at(torch.tensor(contexts))
            self.budgets = [int(k) + policy.interval for k in kept]
        else:
            self.budgets = [policy.resolve_budget(c) for c in contexts]
            if policy.evicts():
                for b in set(self.budgets):
                    policy.check_budget(b)
        self.capacity = max(min(b, c) for b, c in zip(self.budgets, contexts, strict=True))

    def start(self, prompt_lens: list[int]) -> tuple[DecodeRows, torch.Tensor, torch.Tensor]:
        """The batch state before prefill, which rows the prefill round evicts, and where each row's
        observation window starts among the prompt's queries."""
        policy, n_live = self.policy, torch.tensor(prompt_lens, device=self.device)
        if self.per_sequence:
            target = policy.kept_at(n_live).to(self.device)
            budget = target + policy.interval
            evicting = n_live > target
            next_round = torch.where(evicting, n_live, n_live + policy.interval)
        else:
            budget = torch.tensor([self.budgets[i] for i in range(len(prompt_lens))], device=self.device)
            target = budget - policy.interval
            evicting = (n_live >= budget) if policy.evicts() else torch.zeros_like(budget, dtype=torch.bool)
            next_round = torch.where(evicting, n_live, budget)
        batch = DecodeRows(
            torch.arange(len(prompt_lens), device=self.device), n_live - 1, budget, target, n_live
        )
        return batch, evicting, next_round - policy.window_size

    def decode(
        self, batch: DecodeRows, decode_no: int, after_write: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the decode step number ``decode_no`` (1, 2, ...): which rows evict after attending, which
        rows' query is in the observation window, and which rows start a new window after it."""
        policy = self.policy
        if not policy.evicts():
            none = torch.zeros_like(after_write, dtype=torch.bool)
            return none, none, none
        if self.per_sequence:
            batch.target = policy.kept_at(batch.query_index + 1).to(self.device)
            batch.budget = batch.target + policy.interval
            is_round = torch.full_like(after_write, decode_no % policy.interval == 0, dtype=torch.bool)
            in_window = torch.full_like(is_round, (-decode_no) % policy.interval < policy.window_size)
            return is_round & (after_write > batch.target), in_window, is_round
        evicting = after_write >= batch.budget
        return evicting, (batch.budget - after_write) < policy.window_size, evicting


@dataclass
class RoundPlan:
    """For one forward, per batch row: whether a round fires after it, and what it keeps."""

    evicting: torch.Tensor  # [b] bool
    target: torch.Tensor  # [b] entries a round keeps
    budget: torch.Tensor  # [b] what policies see as the budget (target + interval)
    query_index: torch.Tensor  # [b] the last query of the row's chunk
    window_from: torch.Tensor  # [b] queries at or after this index count toward the window statistic

    @property
    def any(self) -> bool:
        return bool(self.evicting.any())


class StreamBudget:
    """When rounds fire and how many entries they keep, for a policy in a multi-turn stream."""

    def __init__(self, policy: EvictionPolicy) -> None:
        if not policy.evicts():
            raise KVStreamsError(f"policy {policy.name!r} evicts nothing: leave it out instead")
        if isinstance(policy.budget, float) and policy.budget_of == "context":
            raise KVStreamsError(
                f"{policy.name}: budget_of = 'context' needs the context length in advance, which a "
                "multi-turn episode does not have; give an entry count or a per-sequence share"
            )
        if isinstance(policy.budget, float) and policy.budget >= 1.0:
            raise KVStreamsError(f"{policy.name}: a share of 1.0 keeps everything: leave the policy out")
        if isinstance(policy.budget, int):
            policy.check_budget(policy.budget)
        self.policy = policy

    def plan(self, live: torch.Tensor, fed: torch.Tensor, chunk: torch.Tensor) -> RoundPlan:
        """``live`` [b] entries held before the forward, ``fed`` [b] tokens fed before it, ``chunk``
        [b] tokens it feeds."""
        p = self.policy
        after, fed_after = live + chunk, fed + chunk
        if isinstance(p.budget, int):
            target = torch.full_like(live, p.budget - p.interval)
            evicting = after >= p.budget
            steps_to_round = (p.budget - live).clamp(min=1)  # tokens until the cache is full
        else:
            target = p.kept_at(fed_after).to(live.device)
            evicting = after >= target + p.interval
            # tokens k until live + k >= ceil(share x (fed + k)) + interval, ignoring the rounding
            gap = (fed.double() * p.budget + p.interval - live.double()) / (1.0 - p.budget)
            steps_to_round = torch.ceil(gap).long().clamp(min=1)
        last_query = fed_after - 1
        round_at = torch.minimum(fed + steps_to_round - 1, last_query)
        window_from = round_at - p.window_size + 1
        return RoundPlan(evicting, target, target + p.interval, last_query, window_from)

    def keep(self, view: EntryView, plan: RoundPlan) -> torch.Tensor:
        """[b, H, N] bool: the entries the round keeps (all live ones in rows that do not evict)."""
        return choose_kept(self.policy, view, plan.target, plan.evicting)


def budget_label(policy: EvictionPolicy) -> str:
    """The budget as trace metadata: an entry count, or the share as a percentage."""
    if isinstance(policy.budget, int):
        return str(policy.budget)
    return f"{math.floor(policy.budget * 1000) / 10:g}%"

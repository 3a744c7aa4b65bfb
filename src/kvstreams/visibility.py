"""Who sees whom: the one rule of kvstreams' record, and the one way to write it.

Every trace carries ``death[l, h, j]``: the trace index of the first query that can no longer see
entry ``j`` in layer ``l``, KV head ``h``. Entry ``j`` is visible to query ``q`` iff

    j <= q < death[j]

(causal from the left, evicted from ``death`` on). An entry that was *recalled* (its archived K/V
put back into the cache after an eviction) is visible again over further intervals, ``recalls[..., j,
k] = (start, end)``: then ``q`` also sees ``j`` iff ``start <= q < end`` for some ``k``. An empty
interval (``start >= end``; :data:`NO_RECALL` is ``(0, 0)``) adds nothing, so a record without
recalls and one with only empty intervals replay the same. The sampler writes ``death`` when it evicts
(:func:`evicted_before`), a finished trace caps it at its length (:func:`at_end`), the learner turns it into masks (:func:`visible`, :func:`dense`), padding and
filler entries see only themselves (:func:`self_only`). Everything else calls these functions, so
the rule is written once.
"""

from __future__ import annotations

import torch

#: ``death`` of an entry that has not been evicted (yet): visible to every later query
NEVER = torch.iinfo(torch.int32).max


#: an empty recall interval: (start, end) with start >= end sees nothing
NO_RECALL = (0, 0)


def visible(query, key, death, recalls=None):
    """``key`` visible to ``query`` given the key's ``death``: ``key <= query < death``, or inside one of
    the key's recall intervals ``recalls[..., k, :] = (start, end)`` (``recalls`` [..., K, 2] shaped
    like ``death`` plus those two trailing dims).

    Works on tensors (broadcast) and on the index scalars of a flex ``mask_mod``."""
    seen = (key <= query) & (query < death)
    if recalls is not None:
        for k in range(recalls.shape[-2]):
            seen = seen | ((recalls[..., k, 0] <= query) & (query < recalls[..., k, 1]))
    return seen


def evicted_before(query):
    """The ``death`` of an entry evicted before ``query`` is computed (the next query when the
    sampler decides): ``query`` is the first that cannot see it. The eviction takes effect from then
    on, never retroactively: the queries before it saw the entry, as the sampler's did."""
    return query


def at_end(death: torch.Tensor, length: int) -> torch.Tensor:
    """The record of a finished trace of ``length`` tokens: entries never evicted (:data:`NEVER`) die
    at the end, so every value lies in [1, length]."""
    return death[..., :length].clamp(max=length)


def recalls_at_end(recalls: torch.Tensor, length: int) -> torch.Tensor:
    """:func:`at_end` for recall intervals [..., T', K, 2]: open intervals end at ``length``, intervals
    that never began (or begin at the end) become :data:`NO_RECALL`."""
    out = recalls[..., :length, :, :].clamp(max=length)
    empty = out[..., 0] >= out[..., 1]
    return out.masked_fill(empty[..., None], 0)


def self_only(index: torch.Tensor) -> torch.Tensor:
    """``death`` for entries at trace ``index`` that only their own query sees (padding and filler
    columns): they never leak into any other query."""
    return index + 1


def dense(death: torch.Tensor, recalls: torch.Tensor | None = None) -> torch.Tensor:
    """death [..., T] (and recalls [..., T, K, 2]) -> bool [..., T(query), T(key)]. The reference
    (quadratic) mask."""
    T = death.shape[-1]
    q = torch.arange(T, device=death.device)[:, None]
    j = torch.arange(T, device=death.device)[None, :]
    return visible(q, j, death[..., None, :], None if recalls is None else recalls[..., None, :, :, :])


def visible_counts(death: torch.Tensor, recalls: torch.Tensor | None = None) -> torch.Tensor:
    """death [..., T] -> [..., T]: how many entries query q sees. Entry j is visible to q iff
    j <= q < death[j], so the count is q + 1 minus the entries that died at or before q: O(T) from a
    histogram of ``death`` (values in [1, T]); each recall interval adds one from its start to its end."""
    T = death.shape[-1]
    died = torch.zeros(*death.shape[:-1], T + 1, dtype=torch.long, device=death.device)
    died.scatter_add_(-1, death.long(), torch.ones_like(death, dtype=torch.long))
    if recalls is not None:
        start, end = recalls[..., 0].flatten(-2).long(), recalls[..., 1].flatten(-2).long()
        live = (start < end).long()
        died.scatter_add_(-1, start.clamp(max=T), -live)  # seen again from start...
        died.scatter_add_(-1, end.clamp(max=T), live)  # ...until end
    return torch.arange(1, T + 1, device=death.device) - died[..., :T].cumsum(-1)

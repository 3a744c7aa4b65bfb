"""Who sees whom: the one rule of kvstreams' record, and the one way to write it.

Every trace carries ``death[l, h, j]``: the trace index of the first query that can no longer see
entry ``j`` in layer ``l``, KV head ``h``. Entry ``j`` is visible to query ``q`` iff

    j <= q < death[j]

(causal from the left, evicted from ``death`` on). The sampler writes ``death`` when it evicts
(:func:`evicted_before`), a finished trace caps it at its length (:func:`at_end`), the learner turns it into masks (:func:`visible`, :func:`dense`), padding and
filler entries see only themselves (:func:`self_only`). Everything else calls these functions, so
the rule is written once.
"""

from __future__ import annotations

import torch

#: ``death`` of an entry that has not been evicted (yet): visible to every later query
NEVER = torch.iinfo(torch.int32).max


def visible(query, key, death):
    """``key`` visible to ``query`` given the key's ``death``: ``key <= query < death``.

    Works on tensors (broadcast) and on the index scalars of a flex ``mask_mod``."""
    return (key <= query) & (query < death)


def evicted_before(query):
    """The ``death`` of an entry evicted before ``query`` is computed (the next query when the
    sampler decides): ``query`` is the first that cannot see it. The eviction takes effect from then
    on, never retroactively: the queries before it saw the entry, as the sampler's did."""
    return query


def at_end(death: torch.Tensor, length: int) -> torch.Tensor:
    """The record of a finished trace of ``length`` tokens: entries never evicted (:data:`NEVER`) die
    at the end, so every value lies in [1, length]."""
    return death[..., :length].clamp(max=length)


def self_only(index: torch.Tensor) -> torch.Tensor:
    """``death`` for entries at trace ``index`` that only their own query sees (padding and filler
    columns): they never leak into any other query."""
    return index + 1


def dense(death: torch.Tensor) -> torch.Tensor:
    """death [..., T] -> bool [..., T(query), T(key)]. The reference (quadratic) mask."""
    T = death.shape[-1]
    q = torch.arange(T, device=death.device)[:, None]
    j = torch.arange(T, device=death.device)[None, :]
    return visible(q, j, death[..., None, :])


def visible_counts(death: torch.Tensor) -> torch.Tensor:
    """death [..., T] -> [..., T]: how many entries query q sees. Entry j is visible to q iff
    j <= q < death[j], so the count is q + 1 minus the entries that died at or before q: O(T) from a
    histogram of ``death`` (values in [1, T])."""
    T = death.shape[-1]
    died = torch.zeros(*death.shape[:-1], T + 1, dtype=torch.long, device=death.device)
    died.scatter_add_(-1, death.long(), torch.ones_like(death, dtype=torch.long))
    return torch.arange(1, T + 1, device=death.device) - died[..., :T].cumsum(-1)

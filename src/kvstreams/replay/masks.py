"""From a trace's ``death`` record to attention masks: a dense SDPA mask and a flex BlockMask.

Visibility is :func:`kvstreams.visibility.visible` per layer and KV head. Without recalls a key's
visible queries form one interval starting at the key itself, so the block structure of the mask
follows from per-block minima and maxima of ``death`` alone: the flex BlockMask is built in
O((T / block)^2) memory without ever materialising the T x T mask. A recalled key is visible over
further intervals; a block's summary then takes the earliest start and latest end of its keys'
recall intervals, which may call a block *partial* that no query-key pair of it sees (the exact
per-entry mask decides inside partial blocks), and never calls one *full* on the strength of a
recall (``full`` still comes from ``death`` alone, where every query of the block sees every key).
"""

from __future__ import annotations

import torch

from kvstreams import visibility


def pad_death(death: torch.Tensor, block_size: int) -> torch.Tensor:
    """death [..., T] padded to a multiple of ``block_size``: each padding key is visible to its own
    (padding) query only, so nothing below T sees it."""
    T = death.shape[-1]
    Tp = -(-T // block_size) * block_size
    if Tp == T:
        return death
    pad = visibility.self_only(torch.arange(T, Tp, device=death.device, dtype=death.dtype))
    return torch.cat([death, pad.expand(*death.shape[:-1], Tp - T)], dim=-1)


def pad_recalls(recalls: torch.Tensor, block_size: int) -> torch.Tensor:
    """recalls [..., T, K, 2] padded like :func:`pad_death`: padding keys have no recall interval."""
    T = recalls.shape[-3]
    Tp = -(-T // block_size) * block_size
    if Tp == T:
        return recalls
    pad = recalls.new_zeros(*recalls.shape[:-3], Tp - T, *recalls.shape[-2:])
    return torch.cat([recalls, pad], dim=-3)


def block_visibility(
    death: torch.Tensor, block_size: int, recalls: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """death [B, H', Tp] (Tp a multiple of block_size; recalls [B, H', Tp, K, 2]) -> (any_visible,
    full), bool [B, H', nq, nk]: whether some / every query of query block Q may see some / sees every
    key of key block K.

    For ``Q > K``: full iff ``Q.end <= min(death over K)``, empty iff ``Q.start >= max(death over K)``
    and no recall interval of K's keys meets Q; the diagonal is always partial (some pairs visible,
    the upper triangle not)."""
    B, Hd, Tp = death.shape
    nb = Tp // block_size
    blocks = death.long().view(B, Hd, nb, block_size)
    min_death = blocks.min(dim=-1).values[:, :, None, :]  # [B, Hd, 1, nb(key block)]
    max_death = blocks.max(dim=-1).values[:, :, None, :]
    qb = torch.arange(nb, device=death.device)[:, None]  # query block
    kb = torch.arange(nb, device=death.device)[None, :]  # key block
    below = (qb > kb)[None, None]
    any_visible = (qb == kb)[None, None] | (below & ((qb * block_size)[None, None] < max_death))
    if recalls is not None and recalls.shape[-2]:
        start, end = recalls[..., 0].long(), recalls[..., 1].long()  # [B, H', Tp, K]
        some = start < end
        big = torch.iinfo(torch.long).max
        first = start.masked_fill(~some, big).view(B, Hd, nb, -1).amin(-1)[:, :, None, :]
        last = end.masked_fill(~some, -1).view(B, Hd, nb, -1).amax(-1)[:, :, None, :]
        meets = ((qb * block_size)[None, None] < last) & (((qb + 1) * block_size)[None, None] > first)
        any_visible = any_visible | (below & meets)
    full = below & (((qb + 1) * block_size)[None, None] <= min_death)
    return any_visible, full


def block_mask_from_death(
    death: torch.Tensor, n_heads: int, block_size: int = 128, recalls: torch.Tensor | None = None
):
    """A flex_attention BlockMask for death [B, H' (1 or H_kv), T] (and recalls [B, H', T, K, 2]) and
    ``n_heads`` query heads."""
    from torch.nn.attention.flex_attention import BlockMask

    _, Hd, T = death.shape
    group = n_heads // Hd
    death = pad_death(death.long(), block_size)
    if recalls is not None:
        recalls = pad_recalls(recalls.long(), block_size)
    any_visible, full = block_visibility(death, block_size, recalls)
    partial = any_visible & ~full  # [B, Hd, nq, nk]

    def as_indices(blocks_mask: torch.Tensor):
        counts = blocks_mask.sum(dim=-1).to(torch.int32)
        indices = (~blocks_mask).to(torch.int8).argsort(dim=-1, stable=True).to(torch.int32)
        return counts, indices

    kv_num, kv_idx = as_indices(partial)
    full_num, full_idx = as_indices(full)
    if group > 1 and Hd > 1:
        kv_num, kv_idx, full_num, full_idx = (
            t.repeat_interleave(group, dim=1) for t in (kv_num, kv_idx, full_num, full_idx)
        )
    heads_per_death = group if Hd > 1 else n_heads

    # one contiguous [B, H', Tp] tensor per interval bound, indexed like ``death``. On CPU with torch
    # 2.13 a compiled mask_mod that read recalls[b, h, kv] as a [K, 2] tensor replayed log-probs 6.1
    # off the sampler's, and strided views of it failed to lower (inductor AssertionError).
    bounds = []
    if recalls is not None:
        bounds = [
            (recalls[..., k, 0].contiguous(), recalls[..., k, 1].contiguous())
            for k in range(recalls.shape[-2])
        ]

    def mask_mod(b, h, q_idx, kv_idx):
        hd = h // heads_per_death
        seen = visibility.visible(q_idx, kv_idx, death[b, hd, kv_idx])
        for start, end in bounds:
            seen = seen | ((start[b, hd, kv_idx] <= q_idx) & (q_idx < end[b, hd, kv_idx]))
        return seen

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(T, T)
    )

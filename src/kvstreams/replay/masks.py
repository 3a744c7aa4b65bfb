"""From a trace's ``death`` record to attention masks: a dense SDPA mask and a flex BlockMask.

Visibility is :func:`kvstreams.visibility.visible` per layer and KV head. Because a key's visible
queries form one interval starting at the key itself, the block structure of the mask follows from
per-block minima and maxima of ``death`` alone: the flex BlockMask is built in O((T / block)^2)
memory without ever materialising the T x T mask.
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


def block_visibility(death: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """death [B, H', Tp] (Tp a multiple of block_size) -> (any_visible, full), bool [B, H', nq, nk]:
    whether some / every query of query block Q sees some / every key of key block K.

    For ``Q > K``: full iff ``Q.end <= min(death over K)``, empty iff ``Q.start >= max(death over K)``;
    the diagonal is always partial (some pairs visible, the upper triangle not)."""
    B, Hd, Tp = death.shape
    nb = Tp // block_size
    blocks = death.long().view(B, Hd, nb, block_size)
    min_death = blocks.min(dim=-1).values[:, :, None, :]  # [B, Hd, 1, nb(key block)]
    max_death = blocks.max(dim=-1).values[:, :, None, :]
    qb = torch.arange(nb, device=death.device)[:, None]  # query block
    kb = torch.arange(nb, device=death.device)[None, :]  # key block
    below = (qb > kb)[None, None]
    any_visible = (qb == kb)[None, None] | (below & ((qb * block_size)[None, None] < max_death))
    full = below & (((qb + 1) * block_size)[None, None] <= min_death)
    return any_visible, full


def block_mask_from_death(death: torch.Tensor, n_heads: int, block_size: int = 128):
    """A flex_attention BlockMask for death [B, H' (1 or H_kv), T] and ``n_heads`` query heads."""
    from torch.nn.attention.flex_attention import BlockMask

    _, Hd, T = death.shape
    group = n_heads // Hd
    death = pad_death(death.long(), block_size)
    any_visible, full = block_visibility(death, block_size)
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

    def mask_mod(b, h, q_idx, kv_idx):
        return visibility.visible(q_idx, kv_idx, death[b, h // heads_per_death, kv_idx])

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(T, T)
    )

"""The flex BlockMask built from death agrees with the dense visibility, block by block."""

from __future__ import annotations

import pytest
import torch

from kvstreams.replay.masks import block_mask_from_death
from kvstreams.visibility import dense as dense_visibility


def random_death(B: int, H: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    j = torch.arange(T)
    life = torch.randint(1, T + 1, (B, H, T), generator=g)
    never = torch.rand(B, H, T, generator=g) < 0.4
    death = torch.where(never, torch.full_like(life, T), (j + life).clamp(max=T))
    return death.int()


@pytest.mark.parametrize(("T", "block", "H", "n_heads"), [(256, 64, 2, 4), (300, 64, 1, 4), (130, 32, 4, 4)])
def test_block_classification_matches_dense(T, block, H, n_heads):
    death = random_death(2, H, T, seed=T)
    bm = block_mask_from_death(death, n_heads=n_heads, block_size=block)
    dense = dense_visibility(death)  # [B, H, T, T]
    nb = -(-T // block)
    pad = nb * block - T
    dense = torch.nn.functional.pad(dense, (0, pad, 0, pad))
    idx = torch.arange(nb * block)
    dense[..., idx[T:], idx[T:]] = True  # padding rows see themselves, as in the mask
    blocks = dense.view(2, H, nb, block, nb, block)
    any_vis = blocks.any(dim=(3, 5))
    all_vis = blocks.all(dim=(3, 5))
    kv_num, kv_idx = bm.kv_num_blocks, bm.kv_indices
    full_num, full_idx = bm.full_kv_num_blocks, bm.full_kv_indices
    group = n_heads // H
    for b in range(2):
        for h in range(n_heads):
            for qb in range(nb):
                hb = min(h, kv_num.shape[1] - 1)  # a head-uniform record gives a 1-head table
                partial = set(kv_idx[b, hb, qb, : kv_num[b, hb, qb]].tolist())
                full = set(full_idx[b, hb, qb, : full_num[b, hb, qb]].tolist())
                hd = h // group
                expected_full = {kb for kb in range(nb) if all_vis[b, hd, qb, kb]}
                expected_any = {kb for kb in range(nb) if any_vis[b, hd, qb, kb]}
                assert full == expected_full
                assert partial | full == expected_any and not partial & full


def test_mask_mod_matches_dense_inside_partial_blocks():
    T, n_heads = 96, 4
    death = random_death(1, 2, T, seed=3)
    bm = block_mask_from_death(death, n_heads=n_heads, block_size=32)
    dense = dense_visibility(death)
    q = torch.arange(T)[:, None].expand(T, T)
    k = torch.arange(T)[None, :].expand(T, T)
    for h in range(n_heads):
        got = bm.mask_mod(torch.tensor(0), torch.tensor(h), q, k)
        assert torch.equal(got, dense[0, h // 2])


def test_block_table_is_subquadratic():
    T, block = 4096, 128
    death = torch.full((1, 1, T), T, dtype=torch.int32)
    bm = block_mask_from_death(death, n_heads=8, block_size=block)
    table_bytes = sum(t.numel() * t.element_size() for t in (bm.kv_indices, bm.full_kv_indices))
    assert table_bytes <= 2 * (T // block) ** 2 * 4 * 8  # blocks^2 ints, versus T^2 = 16M entries
    assert table_bytes < T * T / 100

"""Block-sparse masked attention with a backward that needs no T x T tensor (CPU and GPUs without flex).

The learner's reference backend hands SDPA a dense boolean mask; a mask sends SDPA to its math path,
which keeps the T x T probabilities for the backward (7.4x the memory of causal attention at 4k
tokens, ``docs/benchmarks.md``). torch's flex_attention avoids that but has no backward on CPU.

Here the death record's block structure (``masks.block_visibility``, from per-block min/max; the
flex BlockMask uses it too) says which key blocks any query of a query block can see. Per query
block and KV head, only those key blocks are gathered; scores, softmax and output are computed on
them, with the exact per-entry mask applied to the gathered columns. The forward keeps the output
and the row log-sum-exp only; the backward recomputes each block's probabilities from them (FlashAttention's
recomputation, Dao et al. 2022, Alg. 2, at block granularity in plain torch). Memory is
O(T x head dim) saved plus one block's scores at a time; time is proportional to the visible blocks.

Exact against the dense reference to float rounding (``tests/test_blocksparse.py``). The replay
backend ``blocksparse``; not yet the CPU training default (issue #11: its training pass still takes
2-4x causal attention's time). Batching the KV heads of a query block together (padding each to the
head with the most visible blocks) was tried: 1.4x faster at T = 4k, 1.1x slower at 16k, where the
heads' windows differ most; not kept.
"""

from __future__ import annotations

import torch

from kvstreams.replay.masks import block_visibility, pad_death

BLOCK_SIZE = 128


def visible_key_blocks(death: torch.Tensor, block_size: int) -> list[list[list[torch.Tensor]]]:
    """death [B, Hd, Tp] (Tp a multiple of block_size) -> per b, head, query block: the key indices
    some query of that block can see (every entry of each block that has any visible pair)."""
    any_visible, _ = block_visibility(death, block_size)  # [B, Hd, nq, nk]
    offsets = torch.arange(block_size, device=death.device)
    return [
        [
            [(torch.nonzero(row).flatten()[:, None] * block_size + offsets).flatten() for row in head]
            for head in rows
        ]
        for rows in any_visible
    ]


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, death, scale, block_size):
        B, Hq, T = query.shape[:3]
        Hkv, Hd = key.shape[1], death.shape[1]
        group = Hq // Hkv
        out = torch.empty_like(query)
        lse = query.new_empty(B, Hq, T)
        keys = visible_key_blocks(death, block_size)
        for b, h, idx, rows in _blocks(B, Hkv, Hd, T, block_size, keys):
            q = query[b, h * group : (h + 1) * group, rows]  # [group, n, D]
            s = _scores(q, key[b, h, idx], death[b, h if Hd > 1 else 0, idx], rows, idx, scale)
            m = s.logsumexp(dim=-1, keepdim=True)
            out[b, h * group : (h + 1) * group, rows] = torch.exp(s - m) @ value[b, h, idx]
            lse[b, h * group : (h + 1) * group, rows] = m.squeeze(-1)
        ctx.save_for_backward(query, key, value, death, out, lse)
        ctx.scale, ctx.block_size, ctx.keys = scale, block_size, keys
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, death, out, lse = ctx.saved_tensors
        B, Hq, T = query.shape[:3]
        Hkv, Hd = key.shape[1], death.shape[1]
        group = Hq // Hkv
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        delta = (grad_out * out).sum(dim=-1)  # [B, Hq, T]: rowsum(dO * O), the softmax backward's term
        for b, h, idx, rows in _blocks(B, Hkv, Hd, T, ctx.block_size, ctx.keys):
            heads = slice(h * group, (h + 1) * group)
            q, k, v = query[b, heads, rows], key[b, h, idx], value[b, h, idx]
            s = _scores(q, k, death[b, h if Hd > 1 else 0, idx], rows, idx, ctx.scale)
            p = torch.exp(s - lse[b, heads, rows, None])  # recomputed, never stored
            do = grad_out[b, heads, rows]
            dv[b, h].index_add_(0, idx, (p.transpose(-1, -2) @ do).sum(dim=0))
            ds = p * (do @ v.transpose(-1, -2) - delta[b, heads, rows, None])
            dq[b, heads, rows] = ds @ k * ctx.scale
            dk[b, h].index_add_(0, idx, (ds.transpose(-1, -2) @ q).sum(dim=0) * ctx.scale)
        return dq, dk, dv, None, None, None


def _blocks(B, Hkv, Hd, T, block_size, keys):
    """(b, kv head, visible key indices, query rows) for every query block to compute."""
    for b in range(B):
        for h in range(Hkv):
            for i, idx in enumerate(keys[b][h if Hd > 1 else 0]):
                rows = slice(i * block_size, min(T, (i + 1) * block_size))
                idx = idx[idx < T]
                yield b, h, idx, rows


def _scores(q, k, key_death, rows: slice, idx, scale: float):
    """Scaled scores [group, n, keys] with invisible pairs at -inf: visible(q, j) <=> j <= q < death[j]."""
    positions = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
    mask = (idx[None, :] <= positions) & (positions < key_death[None, :])
    s = (q @ k.transpose(-1, -2)) * scale
    return s.masked_fill(~mask, float("-inf"))


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    death: torch.Tensor,
    scale: float,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Attention [B, Hq, T, D] of query [B, Hq, T, D] over key/value [B, Hkv, T, D] (grouped-query)
    under the record death [B, Hd (1 or Hkv), T]: query q sees key j iff j <= q < death[j]."""
    death = pad_death(death, block_size)
    return _BlockSparseAttention.apply(query, key, value, death, scale, block_size)

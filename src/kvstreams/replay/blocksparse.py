"""Block-sparse masked attention with a backward that needs no T x T tensor (CPU and GPUs without flex).

The learner's reference backend hands SDPA a dense boolean mask; a mask sends SDPA to its math path,
which keeps the T x T probabilities for the backward (7.4x the memory of causal attention at 4k
tokens, ``docs/benchmarks.md``). torch's flex_attention avoids that but has no backward on CPU.

Here the death record's block structure (``masks.block_visibility``, from per-block min/max; the
flex BlockMask uses it too) says, per query block, which key blocks every query sees (*full*) and
which some query sees (*partial*). Per query block and record head, the full blocks' keys are
attended to without a mask and the partial blocks' keys with the exact per-entry mask; the two
results are merged by their row log-sum-exp (as FlashAttention merges key tiles, and as flex
separates full from partial blocks). Keys are gathered once per KV head (a view when they form one
contiguous run) and shared by its query heads without a copy. The forward keeps the output and the row
log-sum-exp only; the backward recomputes each block's probabilities from them (FlashAttention's
recomputation, Dao et al. 2022, Alg. 2, at the granularity of one query block). Memory is
O(T x head dim) saved plus one block's work at a time; time is proportional to the visible blocks.

Each query block goes through one of two kernels with the same contract:

- ``cpu-flash``: on CPU, torch's own fused flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``
  and its ``_backward``, the kernel behind ``is_causal=True`` SDPA), which accepts an additive mask
  and returns the log-sum-exp: one fused call per block, forward and backward.
- ``math``: plain torch (scores, masked softmax, products), for other devices and as the reference
  the fused path is tested against.

Exact against the dense reference to float rounding (``tests/test_blocksparse.py``). History,
measured with ``kvstreams bench learner`` (tiny model, training pass at T = 4k / 16k): plain-torch
blocks 3.5x / 2.8x causal attention's time; the fused kernel with one masked call per block
1.1x / 1.35x; with full blocks unmasked and keys shared, see ``docs/benchmarks.md``. Folding
a KV head's query heads into the rows of one call was slower: the fused backward runs one task per
(batch, head), so one head leaves a core idle. Batching a
query block's record heads together, padded to the head with the most visible blocks, was 1.4x
faster at 4k and 1.1x slower at 16k (the heads' windows differ most there) and was not kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvstreams import visibility
from kvstreams.replay.masks import block_visibility, pad_death, pad_recalls

BLOCK_SIZE = 128
Kernel = Literal["cpu-flash", "math"]


def key_blocks(
    death: torch.Tensor, block_size: int, recalls: torch.Tensor | None = None
) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """death [B, Hd, Tp] (Tp a multiple of block_size; recalls [B, Hd, Tp, K, 2]) -> per b, record
    head, query block: the key indices of its full blocks (every query sees every key) and of its
    partial blocks (some pairs visible; the diagonal block always is one)."""
    any_visible, full = block_visibility(death, block_size, recalls)  # [B, Hd, nq, nk]
    offsets = torch.arange(block_size, device=death.device)

    def indices(blocks: torch.Tensor) -> torch.Tensor:
        return (torch.nonzero(blocks).flatten()[:, None] * block_size + offsets).flatten()

    partial = any_visible & ~full
    return [
        [
            [(indices(f), indices(p)) for f, p in zip(fh, ph, strict=True)]
            for fh, ph in zip(fb, pb, strict=True)
        ]
        for fb, pb in zip(full, partial, strict=True)
    ]


def default_kernel(device: torch.device) -> Kernel:
    cpu_flash = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    return "cpu-flash" if device.type == "cpu" and cpu_flash else "math"


# Per-block kernels: q [Hs, g, n, D] (Hs KV heads, each with its g query heads), k/v [Hs, m, D],
# visible bool [n, m] or None (all visible). forward -> (out [Hs, g, n, D], lse [Hs, g, n], float32 or
# wider); backward -> (dq, dk [Hs, m, D], dv) given the rows' final out and lse, which may cover more
# keys than k (FlashAttention's split-key backward).


def _additive(visible: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if visible is None:
        return None
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")
    )
    return mask[None, None]


def _shared(kv: torch.Tensor, group: int) -> torch.Tensor:
    """[Hs, m, D] -> [Hs, g, m, D] without a copy (stride 0): the query heads of a KV head share it."""
    return kv[:, None].expand(-1, group, -1, -1)


def _flash_forward(q, k, v, visible, scale):
    # batch = KV heads, heads = the group: the fused kernel runs its (batch x head) tasks in parallel
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _shared(k, q.shape[1]), _shared(v, q.shape[1]), attn_mask=_additive(visible, q.dtype), scale=scale
    )


def _flash_backward(do, q, k, v, out, lse, visible, scale):
    g = q.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do,
        q,
        _shared(k, g),
        _shared(v, g),
        out,
        lse,
        0.0,
        False,
        attn_mask=_additive(visible, q.dtype),
        scale=scale,
    )
    return dq, dk.sum(dim=1), dv.sum(dim=1)


def _math_scores(q, k, visible, scale):
    s = q @ k[:, None].transpose(-1, -2) * scale
    return s if visible is None else s.masked_fill(~visible, float("-inf"))


def _math_forward(q, k, v, visible, scale):
    s = _math_scores(q, k, visible, scale)
    lse = s.float().logsumexp(dim=-1) if s.dtype in (torch.float16, torch.bfloat16) else s.logsumexp(dim=-1)
    return torch.exp(s - lse[..., None].to(s.dtype)) @ v[:, None], lse


def _math_backward(do, q, k, v, out, lse, visible, scale):
    s = _math_scores(q, k, visible, scale)
    p = torch.exp(s - lse[..., None].to(s.dtype))  # recomputed, never stored
    delta = (do * out).sum(dim=-1, keepdim=True)  # rowsum(dO * O), the softmax backward's term
    ds = p * (do @ v[:, None].transpose(-1, -2) - delta)
    dk = (ds.transpose(-1, -2) @ q).sum(dim=1) * scale
    return ds @ k[:, None] * scale, dk, (p.transpose(-1, -2) @ do).sum(dim=1)


KERNELS = {"cpu-flash": (_flash_forward, _flash_backward), "math": (_math_forward, _math_backward)}

Keys = slice | torch.Tensor  # a contiguous run of key positions (a view, no copy) or their indices


@dataclass
class _Block:
    """One query block of one record head: query rows [b, heads, rows] and, per part (full, then
    partial), the visible keys of KV heads ``kv_heads`` and the part's mask (None: all visible)."""

    b: int
    heads: slice
    kv_heads: slice
    rows: slice
    parts: list[tuple[Keys, torch.Tensor | None]]


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, death, recalls, scale, block_size, kernel):
        forward_block = KERNELS[kernel][0]
        group = query.shape[1] // key.shape[1]
        out = torch.empty_like(query)
        # the row log-sum-exp, in float32 at least (the fused kernel's own precision for half types)
        lse = query.new_empty(query.shape[:3], dtype=torch.promote_types(query.dtype, torch.float32))
        blocks = list(_blocks(query, key, death, recalls, block_size))
        for blk in blocks:
            at, kv_at = (blk.b, blk.heads, blk.rows), (blk.b, blk.kv_heads)
            q = query[at].unflatten(0, (-1, group))
            results = [
                forward_block(q, key[kv_at][:, keys], value[kv_at][:, keys], visible, scale)
                for keys, visible in blk.parts
            ]
            o, m = _merge(results)
            out[at], lse[at] = o.flatten(0, 1), m.flatten(0, 1)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale, ctx.kernel, ctx.blocks = scale, kernel, blocks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        backward_block = KERNELS[ctx.kernel][1]
        group = query.shape[1] // key.shape[1]
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for blk in ctx.blocks:
            at, kv_at = (blk.b, blk.heads, blk.rows), (blk.b, blk.kv_heads)
            q, do, o, m = (t[at].unflatten(0, (-1, group)) for t in (query, grad_out, out, lse))  # views
            for keys, visible in blk.parts:
                # each part's gradient, from the rows' final out and lse (split-key backward)
                dq_part, dk_part, dv_part = backward_block(
                    do, q, key[kv_at][:, keys], value[kv_at][:, keys], o, m, visible, ctx.scale
                )
                dq[at] += dq_part.flatten(0, 1)
                dk[kv_at][:, keys] += dk_part  # keys are distinct: no accumulation is lost
                dv[kv_at][:, keys] += dv_part
        return dq, dk, dv, None, None, None, None, None


def _blocks(query, key, death, recalls, block_size: int):
    """Every query block to compute. One block covers the heads that share a record: all of them for
    a shared record (Hd = 1), one KV head and its query heads for a per-head record."""
    B, Hq, T = query.shape[:3]
    Hkv, Hd = key.shape[1], death.shape[1]
    kv_per_record, group = Hkv // Hd, Hq // Hkv
    plan = key_blocks(death, block_size, recalls)
    for b in range(B):
        for hd in range(Hd):
            kv_heads = slice(hd * kv_per_record, (hd + 1) * kv_per_record)
            heads = slice(kv_heads.start * group, kv_heads.stop * group)
            for i, (full, partial) in enumerate(plan[b][hd]):
                rows = slice(i * block_size, min(T, (i + 1) * block_size))
                full, partial = full[full < T], partial[partial < T]
                positions = torch.arange(rows.start, rows.stop, device=query.device)[:, None]
                r = None if recalls is None else recalls[b, hd, partial][None]
                visible = visibility.visible(positions, partial[None, :], death[b, hd, partial][None, :], r)
                parts = [(_as_run(full), None)] if len(full) else []
                yield _Block(b, heads, kv_heads, rows, [*parts, (_as_run(partial), visible)])


def _as_run(idx: torch.Tensor) -> Keys:
    """Sorted distinct indices as a slice when they are one contiguous run (gathered as a view)."""
    first, last = int(idx[0]), int(idx[-1])
    return slice(first, last + 1) if last - first + 1 == len(idx) else idx


def _merge(results: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of disjoint key sets from each set's (out, lse)."""
    if len(results) == 1:
        return results[0]
    lse = torch.stack([m for _, m in results]).logsumexp(dim=0)
    out = sum(o * torch.exp(m - lse)[..., None] for o, m in results)
    return out.to(results[0][0].dtype), lse  # type: ignore[union-attr]


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    death: torch.Tensor,
    scale: float,
    block_size: int = BLOCK_SIZE,
    kernel: Kernel | None = None,
    recalls: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention [B, Hq, T, D] of query [B, Hq, T, D] over key/value [B, Hkv, T, D] (grouped-query)
    under the record death [B, Hd (1 or Hkv), T] and recall intervals [B, Hd, T, K, 2]: query q sees
    key j iff j <= q < death[j] or q lies in one of j's recall intervals.
    ``kernel``: per-block kernel (default: ``cpu-flash`` on CPU, ``math`` elsewhere)."""
    death = pad_death(death, block_size)
    if recalls is not None:
        recalls = pad_recalls(recalls, block_size)
    kernel = kernel or default_kernel(query.device)
    return _BlockSparseAttention.apply(query, key, value, death, recalls, scale, block_size, kernel)

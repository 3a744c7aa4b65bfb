"""Learner-side replay: log-probs of traces under the visibility their sampler actually had.

The same Hugging Face model runs one forward over each whole trace (with the trace's own RoPE
positions); every attention layer masks with that layer's ``death`` record, per KV head. Modes:

- ``shadow``: the recorded visibility (log-probs equal the sampler's up to float error);
- ``dense``: ordinary causal attention over the whole trace, ignoring the record (the naive learner).

With one trace per row and nothing evicted (dense mode; re-prefill segments) the visibility is plain
causal attention, and every backend runs it as SDPA's ``is_causal`` (its flash kernel, no mask);
packed, it goes through the backend's mask.

Backends: ``sdpa`` (a dense boolean mask, the reference), ``flex`` (flex_attention with a
BlockMask built from ``death``; compiled, memory linear in T apart from the (T/128)^2 block table;
no backward on CPU) and ``blocksparse`` (``blocksparse.py``: only the visible key blocks, with a
recomputing backward: torch's fused CPU flash kernel per block on CPU, plain torch elsewhere;
memory linear in T; the CPU training default).
Traces can be batched padded (one per row) or packed (concatenated in one row): since a never-evicted
entry dies at the end of its own trace, packing needs nothing beyond offsetting ``death``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvstreams import visibility
from kvstreams.attention import AttentionContext
from kvstreams.errors import KVStreamsError
from kvstreams.models import model_shape
from kvstreams.replay.blocksparse import block_sparse_attention
from kvstreams.replay.masks import block_mask_from_death
from kvstreams.sampling import policy_logprobs
from kvstreams.trace import Trace, TraceFormatError

Mode = Literal["shadow", "dense"]
Backend = Literal["sdpa", "flex", "blocksparse"]
REPLAY_MODES = ("shadow", "dense")
BACKENDS = ("sdpa", "flex", "blocksparse")


@dataclass
class ReplayBatch:
    """Traces laid out for one forward. ``spans[i] = (row, start, length)`` locates trace i."""

    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    death: torch.Tensor  # [B, L or 1, H_kv or 1, T], indices within the row
    spans: list[tuple[int, int, int]]
    sampling: list[tuple[float, int, float]]  # per trace: temperature, top_k, top_p it was sampled with
    causal: bool = False  # the visibility is plain causal attention (one trace per row, nothing evicted)
    # [B, L or 1, H_kv or 1, T, K, 2] recall intervals, when a trace has them
    recalls: torch.Tensor | None = None

    def to(self, device) -> ReplayBatch:
        return dataclasses.replace(
            self,
            tokens=self.tokens.to(device),
            positions=self.positions.to(device),
            death=self.death.to(device),
            recalls=None if self.recalls is None else self.recalls.to(device),
        )


def _layout(
    lengths: list[int], packed: bool, multiple_of: int, offsets: Sequence[int] | None, width: int | None
) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Rows, row width and each trace's (row, start, length), as :func:`collate` documents."""
    if offsets is not None and (packed or len(offsets) != len(lengths)):
        raise KVStreamsError("offsets: one per trace, and only for padded rows")
    if packed:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        rows, needed, spans = 1, sum(lengths), [(0, s, n) for s, n in zip(starts, lengths, strict=True)]
    else:
        starts = list(offsets) if offsets is not None else [0] * len(lengths)
        rows, needed = len(lengths), max(s + n for s, n in zip(starts, lengths, strict=True))
        spans = [(i, s, n) for i, (s, n) in enumerate(zip(starts, lengths, strict=True))]
    needed = -(-needed // multiple_of) * multiple_of
    if width is not None and width < needed:
        raise KVStreamsError(f"traces need rows of {needed} columns, more than the width {width} asked for")
    return rows, (needed if width is None else width), spans


def collate(
    traces: Sequence[Trace],
    n_layers: int,
    n_kv_heads: int,
    mode: Mode = "shadow",
    packed: bool = False,
    multiple_of: int = 1,
    offsets: Sequence[int] | None = None,
    width: int | None = None,
) -> ReplayBatch:
    """Lay traces out padded (one per row) or packed (all in one row), with ``mode``'s visibility.

    ``multiple_of`` rounds the row width up: the flex backend compiles one kernel per shape, so
    widths are bucketed by its block size. ``offsets`` (padded rows only) starts trace i at column
    ``offsets[i]`` of its row, and ``width`` fixes the row width: the layout of trainers that
    left-pad prompts (TRL's prompt + completion rows, :mod:`kvstreams.integrations.trl`).
    """
    if mode not in REPLAY_MODES:
        raise KVStreamsError(f"unknown replay mode {mode!r}; choose {' or '.join(REPLAY_MODES)}")
    if not traces:
        raise KVStreamsError("nothing to replay: no traces")
    L = 1 if mode == "dense" or all(t.death.shape[0] == 1 for t in traces) else n_layers
    H = 1 if mode == "dense" or all(t.death.shape[1] == 1 for t in traces) else n_kv_heads
    K = 0 if mode == "dense" else max(0 if t.recalls is None else t.recalls.shape[3] for t in traces)
    rows, width, spans = _layout([len(t) for t in traces], packed, multiple_of, offsets, width)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, width, dtype=torch.long)
    # Filler entries are visible to themselves only, so they never leak into real queries.
    death = visibility.self_only(torch.arange(width, dtype=torch.int32)).expand(rows, L, H, width).clone()
    recalls = torch.zeros(rows, L, H, width, K, 2, dtype=torch.int32) if K else None  # (0, 0): none
    for trace, (row, start, n) in zip(traces, spans, strict=True):
        tokens[row, start : start + n] = trace.tokens
        positions[row, start : start + n] = trace.positions
        if mode == "dense":
            death[row, :, :, start : start + n] = start + n
        else:
            d = trace.death_for(n_layers, n_kv_heads)[:L, :H] if (L, H) != (1, 1) else trace.death[:1, :1]
            death[row, :, :, start : start + n] = d.expand(L, H, n) + start
            if recalls is not None and trace.recalls is not None:
                r = trace.recalls.expand(L, H, *trace.recalls.shape[2:])
                r = torch.where((r[..., :1] < r[..., 1:]), r + start, r)  # empty intervals stay (0, 0)
                recalls[row, :, :, start : start + n, : r.shape[3]] = r
    sampling = [(t.temperature, t.top_k, t.top_p) for t in traces]
    # One trace per row that evicts nothing (dense mode, or re-prefill segments) is plain causal
    # attention: right padding never reaches a real query, so the row needs no mask at all.
    causal = not packed and (mode == "dense" or all(t.n_evicted == 0 for t in traces))
    causal = causal and not any(start for _, start, _ in spans)  # left padding must stay invisible
    return ReplayBatch(tokens, positions, death, spans, sampling, causal=causal, recalls=recalls)


FLEX_BLOCK_SIZE = 128
_compiled_flex = None


def _flex_attention():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class ReplayMask(AttentionContext):
    """Attention context that masks every layer with its recorded visibility (``causal``: plain causal
    attention, no record needed)."""

    def __init__(
        self,
        death: torch.Tensor,
        backend: Backend,
        n_heads: int,
        causal: bool = False,
        recalls: torch.Tensor | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise KVStreamsError(f"unknown replay backend {backend!r}; choose {' or '.join(BACKENDS)}")
        self.death = death
        self.recalls = recalls
        self.backend = backend
        self.n_heads = n_heads
        self.causal = causal
        self._masks: dict[int, object] = {}

    def mask_for(self, layer: int):
        key = layer if self.death.shape[1] > 1 else 0
        death = self.death[:, key]  # [B, H', T]
        recalls = None if self.recalls is None else self.recalls[:, key]  # [B, H', T, K, 2]
        if self.backend == "blocksparse":  # the kernel reads the record itself
            return death, recalls
        if key not in self._masks:
            if self.backend == "sdpa":
                mask = visibility.dense(death, recalls)  # [B, H', T, T]
                if mask.shape[1] > 1:
                    mask = mask.repeat_interleave(self.n_heads // mask.shape[1], dim=1)
                self._masks[key] = mask
            else:
                self._masks[key] = block_mask_from_death(death, self.n_heads, FLEX_BLOCK_SIZE, recalls)
        return self._masks[key]

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        gqa = query.shape[1] != key.shape[1]
        if self.causal:
            out = F.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=scale, enable_gqa=gqa
            )
            return out.transpose(1, 2)
        mask = self.mask_for(layer)
        if self.backend == "sdpa":
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        elif self.backend == "blocksparse":
            death, recalls = mask
            out = block_sparse_attention(query, key, value, death, scale, recalls=recalls)
        else:
            out = _flex_attention()(query, key, value, block_mask=mask, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)


def check_fits(model, batch: ReplayBatch) -> None:
    """Token ids inside the model's vocabulary, positions inside its range: otherwise an embedding
    lookup fails deep in the model (or, for positions, RoPE silently extrapolates)."""
    shape = model_shape(model)
    if batch.tokens.numel() and int(batch.tokens.max()) >= shape.vocab_size:
        raise TraceFormatError(
            f"trace token id {int(batch.tokens.max())} is outside the model's vocabulary ({shape.vocab_size} ids)"
        )
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and batch.positions.numel() and int(batch.positions.max()) >= limit:
        raise TraceFormatError(
            f"trace position {int(batch.positions.max())} is beyond the model's max_position_embeddings ({limit})"
        )


def replay_logits(model, batch: ReplayBatch, backend: Backend = "sdpa") -> torch.Tensor:
    """Logits [B, T, V] of the model over the batch under the batch's visibility (with grad if enabled)."""
    check_fits(model, batch)
    device = next(model.parameters()).device
    batch = batch.to(device)
    ctx = ReplayMask(batch.death, backend, model_shape(model).n_heads, batch.causal, batch.recalls)
    with ctx:
        return model(input_ids=batch.tokens, position_ids=batch.positions, use_cache=False).logits


def predicting_rows(
    logits: torch.Tensor, batch: ReplayBatch, positions: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits rows [N, V] predicting trace i's tokens at ``positions[i]`` (indices >= 1 within the
    trace), and those tokens [N], in one gather for the whole batch: indexing trace by trace would
    make the backward allocate a logits-sized gradient per trace."""
    row = torch.cat([torch.full_like(p, r) for (r, _, _), p in zip(batch.spans, positions, strict=True)])
    col = torch.cat([s + p for (_, s, _), p in zip(batch.spans, positions, strict=True)])
    device = logits.device
    return logits[row.to(device), (col - 1).to(device)], batch.tokens[row, col].to(device)


def token_logprobs(logits: torch.Tensor, batch: ReplayBatch) -> list[torch.Tensor]:
    """Per trace, [T] log-prob of each token given what precedes it (NaN at index 0), float32 (float64
    for a float64 model), under the distribution the trace was sampled from (temperature, top-k/p)."""
    out = []
    for (row, start, n), (temperature, top_k, top_p) in zip(batch.spans, batch.sampling, strict=True):
        targets = batch.tokens[row, start + 1 : start + n].to(logits.device)
        lp = policy_logprobs(logits[row, start : start + n - 1], targets, temperature, top_k, top_p)
        out.append(torch.cat([lp.new_full((1,), float("nan")), lp]))
    return out


@torch.no_grad()
def replay_logprobs(
    model, traces: Sequence[Trace], mode: Mode = "shadow", backend: Backend = "sdpa", packed: bool = False
) -> list[torch.Tensor]:
    """Log-probs [T] per trace (CPU, float32 or float64 as the model, NaN at index 0) as the learner
    sees them."""
    shape = model_shape(model)
    multiple_of = FLEX_BLOCK_SIZE if backend == "flex" else 1
    batch = collate(
        traces, shape.n_layers, shape.n_kv_heads, mode=mode, packed=packed, multiple_of=multiple_of
    )
    logits = replay_logits(model, batch, backend)
    return [lp.cpu() for lp in token_logprobs(logits, batch)]

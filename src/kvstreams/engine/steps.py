"""Attention contexts, one per kind of forward of a :class:`~kvstreams.engine.stream.StreamSession`.

Each runs inside the model's own forward, per layer (:mod:`kvstreams.attention`), over the session's
:class:`~kvstreams.engine.cache.SlotCache`, and applies the eviction round its schedule asked for:

- :class:`PrefillStep`: a single-turn batch's left-padded prompts, full causal attention through SDPA
  (as in the Shadow Mask paper), then the first round of the batch's :class:`StepSchedule`; the
  prompt's K/V exist only transiently and just the kept entries are written to the cache.
- :class:`DecodeStep`: one token per row of a single-turn batch: write its K/V into a free slot of
  each (sequence, KV head), attend over the live slots only (O(budget), never over the whole prefix),
  then the round if the schedule says one is due; the evicted entries' ``death`` is the next query's
  index, so the decision takes effect from then on.
- :class:`ChunkStep`: one chunk per row of a stream (an observation, a reply's tail, a decode step of
  one token), attending to the row's live slots and causally within itself, then the round of the
  stream's :class:`StreamBudget`, if any.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from kvstreams.attention import AttentionContext
from kvstreams.engine.cache import SlotCache
from kvstreams.engine.compression import DecodeRows, RoundPlan, StreamBudget, choose_kept
from kvstreams.engine.ops import attend_slots, attend_slots_fused
from kvstreams.policies import EntryView, EvictionPolicy
from kvstreams.visibility import evicted_before

_PREFILL_STAT_CHUNK = 256  # query rows per block when prefill attention statistics are needed


def profiled(name: str) -> AbstractContextManager:
    """A named range for ``torch.profiler`` (``kvstreams bench roofline``'s breakdown), only while a
    profiler runs: an unconditional ``record_function`` costs ~5 us, 0.5-0.9% of a SmolLM2 batch-1
    decode step at 30 layers."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class PrefillStep(AttentionContext):
    """Attention context for the prompt: full causal attention, then the first eviction round."""

    def __init__(
        self,
        policy: EvictionPolicy,
        cache: SlotCache,
        col_index: torch.Tensor,
        batch: DecodeRows,
        evicting: torch.Tensor,
        window_from: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        self.policy, self.cache, self.batch = policy, cache, batch
        self.col_index = col_index  # [B, P] trace index of each column, -1 for left padding
        self.evicting = evicting
        self.window_from = window_from  # [B] prompt queries at or after this index are in the window
        self.generator = generator

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        B, H, P, _ = query.shape
        Hkv = key.shape[1]
        valid = self.col_index >= 0
        causal = torch.ones(P, P, dtype=torch.bool, device=query.device).tril()
        mask = causal[None] & valid[:, None, :]
        mask |= torch.eye(P, dtype=torch.bool, device=query.device)[None]  # padding rows see themselves
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask[:, None], scale=scale, enable_gqa=Hkv != H
        )
        policy = self.policy
        cumulative = window = None
        if policy.needs:
            cumulative, window = self._attention_stats(query, key, mask, scale)
        index = self.col_index[:, None, :].expand(B, Hkv, P)
        view = EntryView(
            layer=layer,
            keys=key,
            index=index,
            query_index=self.batch.query_index,
            budget=self.batch.budget,
            attn_cumulative=cumulative,
            attn_window=window,
            generator=self.generator,
        )
        keep = (
            choose_kept(policy, view, self.batch.target, self.evicting)
            if bool(self.evicting.any())
            else view.live
        )
        self.cache.record_death(layer, view.live & ~keep, index, evicted_before(self.batch.query_index + 1))
        if window is not None:
            window = window.masked_fill(self.evicting[:, None, None], 0.0)  # a new window starts
        self.cache.store_prefill(layer, key, value, index, keep, cumulative, window)
        return out.transpose(1, 2)

    def _attention_stats(
        self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention each prompt entry receives: from all queries, and from the observation window."""
        B, H, P, D = query.shape
        Hkv = key.shape[1]
        q = query.float().view(B, Hkv, H // Hkv, P, D)
        k = key.float()[:, :, None]
        valid_q = self.col_index >= 0
        in_window = valid_q & (self.col_index >= self.window_from[:, None])
        cumulative = torch.zeros(B, Hkv, P, device=query.device)
        window = torch.zeros(B, Hkv, P, device=query.device)
        for start in range(0, P, _PREFILL_STAT_CHUNK):
            rows = slice(start, min(P, start + _PREFILL_STAT_CHUNK))
            scores = (q[:, :, :, rows] @ k.transpose(-1, -2)) * scale  # [B, Hkv, g, r, P]
            scores = scores.masked_fill(~mask[:, None, None, rows], float("-inf"))
            probs = scores.softmax(dim=-1).sum(dim=2)  # [B, Hkv, r, P], summed over the KV group
            cumulative += (probs * valid_q[:, None, rows, None]).sum(dim=2)
            window += (probs * in_window[:, None, rows, None]).sum(dim=2)
        return cumulative, window


class DecodeStep(AttentionContext):
    """Attention context for one decode step: write, attend over live slots, maybe evict."""

    def __init__(
        self,
        policy: EvictionPolicy,
        cache: SlotCache,
        batch: DecodeRows,
        evicting: torch.Tensor,
        in_window: torch.Tensor,
        new_window: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        self.policy, self.cache, self.batch = policy, cache, batch
        self.evicting = evicting
        self.any_evicting = bool(evicting.any())
        self.in_window = in_window
        self.new_window = new_window  # rows whose observation window restarts after this step
        self.generator = generator

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        with profiled("kvstreams::attend"):
            out = self._attend(layer, query, key, value, scale)
        if self.any_evicting:
            with profiled("kvstreams::evict"):
                self._evict(layer)
        if self.cache.window is not None:
            self.cache.window[layer].masked_fill_(self.new_window[:, None, None], 0.0)
        return out

    def _attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Write the step's K/V, attend over the live slots, update the policy's attention statistics."""
        cache, batch = self.cache, self.batch
        cache.write_chunk(layer, key, value, batch.query_index[:, None])
        keys, values, index = cache.keys[layer], cache.values[layer], cache.index[layer]
        live = index >= 0
        if cache.cumulative is None and cache.window is None:  # no policy statistic to update
            out = attend_slots_fused(query, keys, values, live[:, :, None, :], scale)
        else:
            out, probs = attend_slots(query, keys, values, live[:, :, None, :], scale)
            received = probs[:, :, :, 0].sum(dim=2)  # attention each entry got from the KV group's heads
            if cache.cumulative is not None:
                cache.cumulative[layer] += received
            if cache.window is not None:
                cache.window[layer] += received * self.in_window[:, None, None]
        return out

    def _evict(self, layer: int) -> None:
        """The eviction round of this layer: the policy scores the live slots, the rest are evicted."""
        cache, batch = self.cache, self.batch
        index = cache.index[layer]
        live = index >= 0
        view = EntryView(
            layer=layer,
            keys=cache.keys[layer],
            index=index,
            query_index=batch.query_index,
            budget=batch.budget,
            attn_cumulative=None if cache.cumulative is None else cache.cumulative[layer],
            attn_window=None if cache.window is None else cache.window[layer],
            generator=self.generator,
        )
        keep = choose_kept(self.policy, view, batch.target, self.evicting)
        cache.evict_slots(layer, live & ~keep, evicted_before(batch.query_index + 1))


class ChunkStep(AttentionContext):
    """Attention context: write each row's chunk, then attend over live slots up to each query; under
    compression, a round may follow (per layer, the policy's scores over the keys at hand)."""

    def __init__(
        self,
        cache: SlotCache,
        write_index: torch.Tensor,
        query_index: torch.Tensor,
        rows: torch.Tensor | None = None,
        compression: StreamBudget | None = None,
        plan: RoundPlan | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.cache = cache
        self.write_index = write_index  # [b, C] trace index of each chunk column, -1 for padding
        self.query_index = query_index  # [b, C] same, with padding columns seeing everything live
        self.rows = rows  # the cache rows the b batch rows are (None: all of them, in order)
        self.compression, self.plan, self.generator = compression, plan, generator

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        cache = self.cache
        if self.compression is not None:
            return self._attend_compressing(layer, query, key, value, scale)
        if self.rows is None:
            cache.write_chunk(layer, key, value, self.write_index)
            keys, values, index = cache.keys[layer], cache.values[layer], cache.index[layer]
        else:
            keys, values, index = cache.write_rows(layer, key, value, self.write_index, self.rows)
        visible = (index[:, :, None, :] >= 0) & (index[:, :, None, :] <= self.query_index[:, None, :, None])
        return attend_slots_fused(query, keys, values, visible, scale)

    def _attend_compressing(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        cache, plan, rows = self.cache, self.plan, self.rows
        assert self.compression is not None and plan is not None and rows is not None
        keys, values, index = cache.write_rows(layer, key, value, self.write_index, rows)
        visible = (index[:, :, None, :] >= 0) & (index[:, :, None, :] <= self.query_index[:, None, :, None])
        cumulative = window = None
        if cache.cumulative is None and cache.window is None:
            out = attend_slots_fused(query, keys, values, visible, scale)
        else:  # the policy scores by attention received: count it per entry
            out, probs = attend_slots(query, keys, values, visible, scale)
            received = probs.sum(dim=2)  # [b, H_kv, C, S], summed over the KV group's query heads
            fed = self.write_index >= 0
            counted = {"cumulative": fed, "window": fed & (self.write_index >= plan.window_from[:, None])}
            for name in ("cumulative", "window"):
                stat = getattr(cache, name)
                if stat is not None:
                    add = (received * counted[name][:, None, :, None]).sum(dim=2)
                    stat[layer].index_add_(0, rows, add)
            cumulative = None if cache.cumulative is None else cache.cumulative[layer].index_select(0, rows)
            window = None if cache.window is None else cache.window[layer].index_select(0, rows)
        if plan.any:
            view = EntryView(
                layer=layer,
                keys=keys,
                index=index,
                query_index=plan.query_index,
                budget=plan.budget,
                attn_cumulative=cumulative,
                attn_window=window,
                generator=self.generator,
            )
            keep = self.compression.keep(view, plan)
            cache.evict_rows(layer, (index >= 0) & ~keep, rows, evicted_before(plan.query_index + 1))
            if cache.window is not None:  # a new observation window starts after a round
                reset = (
                    cache.window[layer].index_select(0, rows).masked_fill(plan.evicting[:, None, None], 0.0)
                )
                cache.window[layer].index_copy_(0, rows, reset)
        return out

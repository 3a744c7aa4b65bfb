"""A persistent batch of KV streams for multi-turn episodes.

Each row holds one episode's trace: tokens are appended to the row's record (sampled by the model
or given by the environment) and fed through the model on the next :meth:`StreamSession.forward`,
as one chunk per row. Chunks attend to the row's live cache slots and causally among themselves;
their K/V go into free slots. :meth:`StreamSession.evict` deletes a span of the trace in place
(every layer and head), recording ``death`` = the next query's index; the rest of the cache, and
every retained entry's original K/V and position, is untouched. :meth:`StreamSession.restart` is
the standard pipeline's alternative: the row's trace ends and a new one starts from given tokens,
which are prefilled again with positions from 0. Given an eviction ``policy``, the session also
compresses: after a forward, a row whose cache reached the budget drops entries per layer and KV head
(:mod:`kvstreams.engine.compression`), recorded in the same ``death`` record. A span deleted with
``archive=True`` can come back: :meth:`StreamSession.recall` puts its archived K/V back into the cache
(same values, same positions), visible again from the next query; the trace records the new
interval (``recalls``), so the learner replays the recall exactly as it replays an eviction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvstreams.attention import AttentionContext
from kvstreams.engine.cache import SlotCache
from kvstreams.engine.compression import RoundPlan, StreamBudget
from kvstreams.engine.ops import attend_slots, attend_slots_fused
from kvstreams.engine.record import Record
from kvstreams.models import model_shape
from kvstreams.policies import EntryView, EvictionPolicy
from kvstreams.sampling import at_least_float32
from kvstreams.trace import Trace
from kvstreams.visibility import evicted_before


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


@dataclass
class SessionCounters:
    tokens_forwarded: int = 0  # tokens fed through the model (chunks and decode steps)
    tokens_reprefilled: int = 0  # retained tokens fed again after a restart
    kv_peak_entries: int = 0  # most live entries any row held (per layer and head)
    kv_peak_bytes: int = 0  # most K/V bytes allocated for the batch
    archive_peak_bytes: int = 0  # most K/V bytes held in the recall archive
    entries_recalled: int = 0  # entries put back by recall (layer 0, head 0)
    decode_tokens: int = 0  # tokens fed by forwards that fed one token per row (decode steps)
    decode_seconds: float = 0.0
    chunk_seconds: float = 0.0  # forwards that fed a longer chunk to some row (prefill, re-prefill)


class StreamSession:
    def __init__(
        self,
        model,
        n_rows: int,
        initial_capacity: int = 256,
        initial_length: int = 1024,
        weights_version: int = 0,
        policy: EvictionPolicy | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.shape = model_shape(model)
        device = next(model.parameters()).device
        self.device = device
        # compression inside the stream: the policy's rounds after each forward (None: no compression)
        self.compression = StreamBudget(policy) if policy is not None else None
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for random policies
        track = policy.needs if policy is not None else frozenset()
        self.cache = SlotCache(
            self.shape, n_rows, initial_capacity, initial_length, model.dtype, device, track
        )
        self.records = [Record() for _ in range(n_rows)]
        self.weights_version = weights_version  # the weights version; appended tokens record it
        self.counters = SessionCounters(kv_peak_bytes=self.cache.kv_bytes)

    # --- the record ------------------------------------------------------------------------------
    def append(
        self,
        row: int,
        tokens: list[int],
        sampled: bool = False,
        loss: bool = False,
        logprobs: list[float] | None = None,
    ) -> tuple[int, int]:
        """Add tokens to a row's trace (fed on the next forward). Returns their [start, end) indices."""
        return self.records[row].append(tokens, self.weights_version, sampled, loss, logprobs)

    def length(self, row: int) -> int:
        return len(self.records[row])

    def tokens(self, row: int, start: int, end: int) -> list[int]:
        """The token ids of trace span [start, end) of ``row``."""
        return self.records[row].tokens[start:end]

    def fed(self, row: int) -> int:
        """How many of ``row``'s tokens are in the cache (the next query's trace index)."""
        return self.records[row].fed

    # --- the model -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, rows: list[int]) -> torch.Tensor:
        """Feed the unfed tokens of ``rows`` (as one padded batch of their chunks); returns
        [len(rows), V] logits after each row's last token. Other rows are left out of the forward."""
        started = time.perf_counter()
        chunks = [self.records[r].tokens[self.records[r].fed :] for r in rows]
        if any(len(c) == 0 for c in chunks):
            raise ValueError("forward() on a row with nothing to feed")
        n, C = len(rows), max(len(c) for c in chunks)
        self.cache.reserve(C)
        self.cache.reserve_time(max(len(r) for r in self.records))
        ids = torch.zeros(n, C, dtype=torch.long)
        write = torch.full((n, C), -1, dtype=torch.long)
        for i, (r, chunk) in enumerate(zip(rows, chunks, strict=True)):
            start = self.records[r].fed
            ids[i, : len(chunk)] = torch.tensor(chunk)
            write[i, : len(chunk)] = torch.arange(start, start + len(chunk))
        query = torch.where(write >= 0, write, torch.iinfo(torch.long).max)
        positions = write.clamp(min=0)
        # Rows with nothing to feed stay out of the batch (they would cost C tokens of padding each).
        every_row = list(rows) == list(range(len(self.records)))
        subset = None if every_row and self.compression is None else torch.tensor(rows, device=self.device)
        plan = self._round_plan(rows, chunks) if self.compression is not None else None
        step = ChunkStep(
            self.cache,
            write.to(self.device),
            query.to(self.device),
            subset,
            self.compression,
            plan,
            self.generator,
        )
        with step:
            logits = self.model(
                input_ids=ids.to(self.device), position_ids=positions.to(self.device), use_cache=False
            ).logits
        last = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        out = at_least_float32(logits[torch.arange(n, device=self.device), last])
        for r, chunk in zip(rows, chunks, strict=True):
            self.records[r].fed += len(chunk)
            self.counters.tokens_forwarded += len(chunk)
        live = int((self.cache.index[0] >= 0).sum(-1).max())
        self.counters.kv_peak_entries = max(self.counters.kv_peak_entries, live)
        self.counters.kv_peak_bytes = max(self.counters.kv_peak_bytes, self.cache.kv_bytes)
        seconds = time.perf_counter() - started
        if C == 1:
            self.counters.decode_tokens += len(rows)
            self.counters.decode_seconds += seconds
        else:
            self.counters.chunk_seconds += seconds
        return out

    def _round_plan(self, rows: list[int], chunks: list[list[int]]) -> RoundPlan:
        """Whether a compression round follows this forward, per row (see :class:`StreamBudget`)."""
        assert self.compression is not None
        rows_t = torch.tensor(rows, device=self.device)
        live = (self.cache.index[0].index_select(0, rows_t) >= 0).sum(-1).amax(-1)  # [b], most over heads
        fed = torch.tensor([self.records[r].fed for r in rows], device=self.device)
        chunk = torch.tensor([len(c) for c in chunks], device=self.device)
        return self.compression.plan(live, fed, chunk)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights in place between steps. The cache is kept (its K/V were computed under the
        old weights); tokens sampled from now on record ``version``."""
        self.model.load_state_dict(state_dict, strict=True)
        self.weights_version = version

    # --- compaction --------------------------------------------------------------------------------
    def evict(self, row: int, start: int, end: int, archive: bool = False) -> int:
        """Delete trace span [start, end) of ``row`` in place; returns how many entries were live.

        The next query (the first unfed token) is the first that cannot see them. With ``archive``,
        their K/V are kept so that :meth:`recall` can put them back.
        """
        rec = self.records[row]
        if end > rec.fed:
            raise ValueError(f"cannot evict [{start}, {end}): only {rec.fed} tokens are in the cache")
        n = self.cache.evict_range(row, start, end, at=evicted_before(rec.fed), archive=archive)
        if archive:
            self.counters.archive_peak_bytes = max(self.counters.archive_peak_bytes, self.cache.archive_bytes)
        return n

    def delete(self, row: int, spans: list[tuple[int, int]], archive: bool = False) -> None:
        """Delete trace spans of ``row`` in place, the KV-streams way (one continuous cache). Tokens of a
        span not yet in the cache (the tail of a reply just written) are fed first: they were part of
        the context the model saw, so their queries are computed and their entries recorded before
        they die together with the rest of the span, at the next query."""
        if spans and max(end for _, end in spans) > self.records[row].fed:
            self.forward([row])
        for start, end in spans:
            self.evict(row, start, end, archive=archive)

    def recall(self, row: int, start: int, end: int) -> int:
        """Put the archived entries of trace span [start, end) of ``row`` back into the cache, with the K/V
        (and positions) they were written with; the next query is the first that sees them again.
        Returns how many came back (layer 0, head 0): entries never archived (or compressed away
        before the span was deleted) stay deleted."""
        rec = self.records[row]
        n = self.cache.recall(row, start, end, at=rec.fed)
        self.counters.entries_recalled += n
        live = int((self.cache.index[0] >= 0).sum(-1).max())
        self.counters.kv_peak_entries = max(self.counters.kv_peak_entries, live)
        self.counters.kv_peak_bytes = max(self.counters.kv_peak_bytes, self.cache.kv_bytes)
        return n

    def restart(self, row: int, tokens: list[int], meta: dict[str, str]) -> Trace:
        """End the row's trace (returned) and start a new one holding ``tokens`` as context."""
        trace = self.trace(row, meta)
        self.cache.clear_row(row)
        self.records[row] = Record()
        self.append(row, tokens)
        self.counters.tokens_reprefilled += len(tokens)
        return trace

    def trace(self, row: int, meta: dict[str, str]) -> Trace:
        cache = self.cache
        recalls = None if cache.recalls is None else cache.recalls[row]
        return self.records[row].to_trace(cache.death[row], meta, recalls)

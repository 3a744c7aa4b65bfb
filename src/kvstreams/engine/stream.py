"""The one sampling session: a batch of KV streams over one :class:`~kvstreams.engine.cache.SlotCache`,
single-turn or multi-turn.

Each row holds one sequence's trace: tokens are appended to the row's
:class:`~kvstreams.engine.record.Record` (sampled by the model or given by the environment), and
every eviction, whoever decides it, is written to the cache's one visibility record (``death``, and
``recalls`` after a recall); :meth:`StreamSession.trace` and :meth:`StreamSession.generate` join the
two in a :class:`~kvstreams.trace.Trace`. The forwards run inside the model through the attention
contexts of :mod:`kvstreams.engine.steps`.

Multi-turn episodes (driven by :class:`~kvstreams.episodes.EpisodeRunner`): appended tokens are fed
on the next :meth:`StreamSession.forward`, as one chunk per row that attends to the row's live slots
and causally within itself. :meth:`StreamSession.evict` deletes a span of the trace in place (every
layer and head), recording ``death`` = the next query's index; the rest of the cache, and every
retained entry's original K/V and position, is untouched. :meth:`StreamSession.restart` is the
standard pipeline's alternative: the row's trace ends and a new one starts from given tokens, which
are prefilled again with positions from 0. Given an eviction ``policy``, the session also compresses:
after a forward, a row whose cache reached its :class:`~kvstreams.engine.compression.StreamBudget`
drops entries per layer and KV head. A span deleted with ``archive=True`` can come back:
:meth:`StreamSession.recall` puts its archived K/V back into the cache (same values, same positions),
visible again from the next query; the trace records the new interval (``recalls``), so the learner
replays the recall exactly as it replays an eviction.

Single-turn batches (:meth:`StreamSession.for_prompts`, then :meth:`StreamSession.generate`): one
prompt per row, left-padded and prefilled densely, then one sampled token per row and decode step;
the policy's rounds follow the batch's per-step
:class:`~kvstreams.engine.compression.StepSchedule` (budgets known in advance, which also size the
cache), and rows that finish leave the batch and the cache. The two schedules stay two values
(:mod:`kvstreams.engine.compression` says how their rounds differ): folding one into the other would
change the rounds, and so the traces, of one of the two.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstreams.engine.cache import SlotCache
from kvstreams.engine.compression import DecodeRows, RoundPlan, StepSchedule, StreamBudget
from kvstreams.engine.record import Record
from kvstreams.engine.steps import ChunkStep, DecodeStep, PrefillStep, profiled
from kvstreams.errors import KVStreamsError
from kvstreams.models import check_attention, model_shape
from kvstreams.policies import EvictionPolicy, make_policy
from kvstreams.sampling import SamplingParams, at_least_float32, sample
from kvstreams.trace import Trace
from kvstreams.visibility import evicted_before


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


@dataclass
class GenerationStats:
    """What one single-turn :meth:`StreamSession.generate` did."""

    sequences: int = 0
    tokens_generated: int = 0
    tokens_prefilled: int = 0
    eviction_events: list[int] = field(default_factory=list)  # per sequence
    budgets: list[int] = field(default_factory=list)
    kv_capacity: int = 0  # slots per (sequence, layer, KV head)
    kv_bytes_allocated: int = 0


class StreamSession:
    """One batch of sequences sampled over one :class:`SlotCache` (see the module's docstring)."""

    def __init__(
        self,
        model,
        n_rows: int,
        initial_capacity: int = 256,
        initial_length: int = 1024,
        weights_version: int = 0,
        policy: EvictionPolicy | None = None,
        seed: int = 0,
        schedule: StepSchedule | None = None,
    ) -> None:
        """A multi-turn stream of ``n_rows`` rows (``policy`` compressing under a :class:`StreamBudget`),
        or, given the per-step ``schedule`` of its policy, a single-turn batch (:meth:`for_prompts`)."""
        self.model = model
        self.shape = model_shape(model)
        device = next(model.parameters()).device
        self.device = device
        self.policy = policy
        # when the policy's rounds fire: per decode step of a single-turn batch (``schedule``), or after
        # each forward of the stream (``compression``); both None: no compression
        self.schedule = schedule
        self.compression = StreamBudget(policy) if policy is not None and schedule is None else None
        self.generator = torch.Generator(device=device).manual_seed(seed)  # sampling, random policies
        track = policy.needs if policy is not None else frozenset()
        self.cache = SlotCache(
            self.shape, n_rows, initial_capacity, initial_length, model.dtype, device, track
        )
        self.records = [Record() for _ in range(n_rows)]
        self.weights_version = weights_version  # the weights version; appended tokens record it
        self.counters = SessionCounters(kv_peak_bytes=self.cache.kv_bytes)  # the stream's forwards
        self.sampling: SamplingParams | None = None  # a single-turn batch's, until it is generated
        self.stats = GenerationStats()  # what the single-turn generate() did

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

    # --- a single-turn batch ---------------------------------------------------------------------
    @classmethod
    def for_prompts(
        cls,
        model,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        policy: EvictionPolicy | None = None,
        weights_version: int = 0,
    ) -> StreamSession:
        """A single-turn batch: one row per prompt, one continuation each to sample with ``params``
        (:meth:`generate`). ``policy`` (default: none) evicts per decode step under the batch's
        :class:`StepSchedule`, whose budgets (from prompt + ``params.max_new_tokens``) size the cache;
        ``params.seed`` seeds the draws and random policies."""
        check_attention(model)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise KVStreamsError("every prompt needs at least one token")
        policy = policy or make_policy("full")
        contexts = [len(p) + params.max_new_tokens for p in prompts]
        schedule = StepSchedule(policy, contexts, next(model.parameters()).device)
        session = cls(
            model,
            len(prompts),
            schedule.capacity,
            max(contexts),
            weights_version,
            policy,
            params.seed,
            schedule,
        )
        for row, prompt in enumerate(prompts):
            session.append(row, list(prompt))
        session.sampling = params
        return session

    @torch.no_grad()
    def generate(
        self,
        tokenizer=None,
        model_name: str = "",
        progress: Callable[[int], None] | None = None,
        on_step: Callable[[int, StreamSession], None] | None = None,
    ) -> list[Trace]:
        """Sample the batch made by :meth:`for_prompts`, once: one :class:`Trace` per prompt, in order.

        A row ends at a stop token (``params.stop_token_ids``, else the ``tokenizer``'s end of sequence)
        or at ``max_new_tokens``, and leaves the batch and the cache. ``progress(1)`` is called after
        every decode step (for progress bars); ``on_step(n, session)`` too, where it may call
        :meth:`update_weights` (asynchronous training). What it did is in :attr:`stats`.
        """
        params, schedule, self.sampling = self.sampling, self.schedule, None
        if params is None or schedule is None:
            raise KVStreamsError("generate() samples a batch made by StreamSession.for_prompts, once")
        G, stop_ids = params.max_new_tokens, _stop_ids(params, tokenizer)
        prompt_lens = [len(rec) for rec in self.records]
        kv_bytes_allocated = self.cache.kv_bytes  # the peak: rows are only ever removed
        rows, logits, evicting = self._prefill(getattr(tokenizer, "pad_token_id", None) or 0)
        events = evicting.long().clone()  # eviction rounds per row so far
        left = _Finished(len(prompt_lens))
        for step_no in range(G):
            with profiled("kvstreams::sample"):
                new_tokens, new_lp = sample(logits, params, self.generator)
            done = self._add_sampled(rows.seq, new_tokens, new_lp, stop_ids, step_no == G - 1)
            if progress is not None:
                progress(1)
            if on_step is not None:  # may update the weights: the next tokens record the new version
                on_step(step_no + 1, self)
            if done:  # finished sequences leave the batch; their record is complete
                left.add(done, rows.seq, self.cache.death, events)
                if len(done) == len(rows.seq):
                    break
                new_tokens, events = self._drop_rows(done, rows, new_tokens, events)
            logits, evicting = self._decode(new_tokens, step_no + 1, rows)
            events += evicting.long()
        self.stats = GenerationStats(
            sequences=len(prompt_lens),
            tokens_generated=sum(len(r) - p for r, p in zip(self.records, prompt_lens, strict=True)),
            tokens_prefilled=sum(prompt_lens),
            eviction_events=left.events,
            budgets=schedule.budgets,
            kv_capacity=schedule.capacity,
            kv_bytes_allocated=kv_bytes_allocated,
        )
        model_name = model_name or str(getattr(self.model.config, "_name_or_path", ""))
        return [
            self._batch_trace(i, left.deaths[i], prompt_lens[i], params, model_name)
            for i in range(len(prompt_lens))
        ]

    def _prefill(self, pad_id: int) -> tuple[DecodeRows, torch.Tensor, torch.Tensor]:
        """Forward the left-padded prompts (an eviction round where a prompt exceeds its budget); the
        rows' decoding state, the last position's logits and which rows evicted."""
        assert self.schedule is not None and self.policy is not None
        prompts = [rec.tokens for rec in self.records]
        rows, evicting, window_from = self.schedule.start([len(p) for p in prompts])
        ids, col_index = _left_padded(prompts, pad_id, self.device)
        with PrefillStep(self.policy, self.cache, col_index, rows, evicting, window_from, self.generator):
            logits = self.model(
                input_ids=ids, position_ids=col_index.clamp(min=0), logits_to_keep=1, use_cache=False
            ).logits[:, -1]
        rows.n_live = torch.where(evicting, rows.target, rows.n_live)
        return rows, logits, evicting

    def _decode(
        self, new_tokens: torch.Tensor, step: int, rows: DecodeRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the tokens just sampled: their K/V join the cache, maybe an eviction round follows;
        the next logits and which rows evicted."""
        assert self.schedule is not None and self.policy is not None
        rows.query_index = rows.query_index + 1
        after_write = rows.n_live + 1
        evicting, in_window, new_window = self.schedule.decode(rows, step, after_write)
        with DecodeStep(self.policy, self.cache, rows, evicting, in_window, new_window, self.generator):
            logits = self.model(
                input_ids=new_tokens[:, None], position_ids=rows.query_index[:, None], use_cache=False
            ).logits[:, -1]
        rows.n_live = torch.where(evicting, rows.target, after_write)
        return logits, evicting

    def _add_sampled(
        self, seqs: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: set[int], last: bool
    ) -> list[int]:
        """Append each row's sampled token to its sequence's record; returns the rows that finished (a
        stop token or ``last``)."""
        done = []
        for row, (seq, tok, lp) in enumerate(
            zip(seqs.tolist(), tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            self.append(seq, [tok], sampled=True, loss=True, logprobs=[lp])
            if tok in stop_ids or last:
                done.append(row)
        return done

    def _drop_rows(
        self, done: list[int], rows: DecodeRows, *per_row: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Remove the ``done`` rows from the batch and the cache (and from each of ``per_row``, returned)."""
        keep = torch.tensor([r for r in range(len(rows.seq)) if r not in set(done)], device=rows.seq.device)
        self.cache.select_rows(keep)
        rows.select(keep)
        return tuple(t.index_select(0, keep) for t in per_row)

    def _batch_trace(
        self, i: int, death: torch.Tensor | None, prompt_len: int, params: SamplingParams, model_name: str
    ) -> Trace:
        assert death is not None and self.policy is not None and self.schedule is not None
        rec, policy, budget = self.records[i], self.policy, self.schedule.budgets[i]
        return rec.to_trace(
            death,
            {
                "temperature": str(params.temperature),
                "top_p": str(params.top_p),
                "top_k": str(params.top_k),
                "policy": policy.name,
                "policy_config": json.dumps(policy.describe()),
                "budget": str(budget if policy.evicts() else len(rec)),
                "mode": "stream",
                "model": model_name,
                "prompt_len": str(prompt_len),
                "seed": str(params.seed),
            },
        )


class _Finished:
    """What a single-turn batch keeps of each sequence (by its row in the session) once it finished
    and left the cache: its death record and how many eviction rounds it had."""

    def __init__(self, n: int) -> None:
        self.deaths: list[torch.Tensor | None] = [None] * n
        self.events = [0] * n

    def add(self, rows: list[int], seqs: torch.Tensor, death: torch.Tensor, events: torch.Tensor) -> None:
        for row in rows:
            seq = int(seqs[row])
            self.deaths[seq] = death[row].clone()
            self.events[seq] = int(events[row])


def _stop_ids(params: SamplingParams, tokenizer) -> set[int]:
    if params.stop_token_ids is not None:
        return set(params.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if eos is not None else set()


def _left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch: ids [n, P] and each column's trace index (-1: padding)."""
    n, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, P), pad_id, dtype=torch.long, device=device)
    col_index = torch.full((n, P), -1, dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        ids[b, P - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long, device=device)
        col_index[b, P - len(prompt) :] = torch.arange(len(prompt), device=device)
    return ids, col_index

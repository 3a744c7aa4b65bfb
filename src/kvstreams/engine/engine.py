"""The rollout engine: batched sampling with in-place KV eviction, recording who saw what.

One decode step for a batch (per layer, inside the model's own forward, through
:mod:`kvstreams.attention`):

1. write the new token's K/V into a free slot of each (sequence, KV head);
2. attend over the live slots only (O(budget), never over the whole prefix);
3. if the sequence's cache is now full, ask the policy which entries stay and free the others'
   slots; their ``death`` is the next query's index, so the decision takes effect from then on.

Prefill uses full causal attention over the prompt (as in the Shadow Mask paper); the prompt's K/V
exist only transiently and just the kept entries are written to the budget-sized cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from kvstreams.attention import AttentionContext
from kvstreams.engine.cache import SlotCache
from kvstreams.engine.compression import choose_kept
from kvstreams.engine.ops import attend_slots, attend_slots_fused
from kvstreams.engine.record import Record
from kvstreams.errors import KVStreamsError
from kvstreams.models import model_shape
from kvstreams.policies import EntryView, EvictionPolicy, make_policy
from kvstreams.sampling import SamplingParams, sample
from kvstreams.trace import Trace
from kvstreams.visibility import evicted_before

_PREFILL_STAT_CHUNK = 256  # query rows per block when prefill attention statistics are needed


def _mark(name: str) -> AbstractContextManager:
    """A named range for ``torch.profiler`` (``kvstreams bench roofline``'s breakdown), only while a
    profiler runs: an unconditional ``record_function`` costs ~5 us, 0.5-0.9% of a SmolLM2 batch-1
    decode step at 30 layers."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


@dataclass
class _Batch:
    """Per-row state of the sequences still being decoded (rows leave when they finish)."""

    seq: torch.Tensor  # [B] original sequence number
    query_index: torch.Tensor  # [B] trace index of the token fed at this step
    budget: torch.Tensor  # [B]
    target: torch.Tensor  # [B] entries kept by an eviction round
    n_live: torch.Tensor  # [B] live entries per (layer, head) before this step's write

    def select(self, rows: torch.Tensor) -> None:
        for name in ("seq", "query_index", "budget", "target", "n_live"):
            setattr(self, name, getattr(self, name).index_select(0, rows))


class PrefillStep(AttentionContext):
    """Attention context for the prompt: full causal attention, then the first eviction round."""

    def __init__(
        self,
        engine: RolloutEngine,
        cache: SlotCache,
        col_index: torch.Tensor,
        batch: _Batch,
        evicting: torch.Tensor,
        window_from: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        self.engine, self.cache, self.batch = engine, cache, batch
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
        policy = self.engine.policy
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
        engine: RolloutEngine,
        cache: SlotCache,
        batch: _Batch,
        evicting: torch.Tensor,
        in_window: torch.Tensor,
        new_window: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        self.engine, self.cache, self.batch = engine, cache, batch
        self.evicting = evicting
        self.any_evicting = bool(evicting.any())
        self.in_window = in_window
        self.new_window = new_window  # rows whose observation window restarts after this step
        self.generator = generator

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        with _mark("kvstreams::attend"):
            out = self._attend(layer, query, key, value, scale)
        if self.any_evicting:
            with _mark("kvstreams::evict"):
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
        keep = choose_kept(self.engine.policy, view, batch.target, self.evicting)
        cache.evict_slots(layer, live & ~keep, evicted_before(batch.query_index + 1))


class Schedule:
    """When eviction rounds fire and how many entries they keep, per sequence.

    - A budget per sequence (a fractional budget, ``budget_of = "sequence"``, the default; SMD's
      "retaining only 50% of the KV tokens per sequence"): a round after the dense prefill and then
      every ``interval`` decode steps keeps ceil(share x the sequence's tokens so far) entries (at
      least what the policy pins), so a reply that stops early is compressed at the nominal share.
    - A fixed budget (an entry count, or a share of prompt + max new tokens with ``budget_of =
      "context"``): a round whenever the cache holds ``budget`` entries keeps ``budget - interval``.

    ``batch.budget`` is what policies see as the budget: the entries kept plus ``interval``.
    """

    def __init__(self, policy: EvictionPolicy, prompt_lens: list[int], contexts: list[int], device) -> None:
        self.policy, self.device = policy, device
        self.per_sequence = policy.per_sequence
        if self.per_sequence:
            kept = policy.kept_at(torch.tensor(contexts))
            self.budgets = [int(k) + policy.interval for k in kept]
        else:
            self.budgets = [policy.resolve_budget(c) for c in contexts]
            if policy.evicts():
                for b in set(self.budgets):
                    policy.check_budget(b)
        self.capacity = max(min(b, c) for b, c in zip(self.budgets, contexts, strict=True))

    def start(self, prompt_lens: list[int]) -> tuple[_Batch, torch.Tensor, torch.Tensor]:
        """The batch state before prefill, which rows the prefill round evicts, and where each row's
        observation window starts among the prompt's queries."""
        policy, n_live = self.policy, torch.tensor(prompt_lens, device=self.device)
        if self.per_sequence:
            target = policy.kept_at(n_live).to(self.device)
            budget = target + policy.interval
            evicting = n_live > target
            next_round = torch.where(evicting, n_live, n_live + policy.interval)
        else:
            budget = torch.tensor([self.budgets[i] for i in range(len(prompt_lens))], device=self.device)
            target = budget - policy.interval
            evicting = (n_live >= budget) if policy.evicts() else torch.zeros_like(budget, dtype=torch.bool)
            next_round = torch.where(evicting, n_live, budget)
        batch = _Batch(torch.arange(len(prompt_lens), device=self.device), n_live - 1, budget, target, n_live)
        return batch, evicting, next_round - policy.window_size

    def decode(
        self, batch: _Batch, decode_no: int, after_write: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the decode step number ``decode_no`` (1, 2, ...): which rows evict after attending, which
        rows' query is in the observation window, and which rows start a new window after it."""
        policy = self.policy
        if not policy.evicts():
            none = torch.zeros_like(after_write, dtype=torch.bool)
            return none, none, none
        if self.per_sequence:
            batch.target = policy.kept_at(batch.query_index + 1).to(self.device)
            batch.budget = batch.target + policy.interval
            is_round = torch.full_like(after_write, decode_no % policy.interval == 0, dtype=torch.bool)
            in_window = torch.full_like(is_round, (-decode_no) % policy.interval < policy.window_size)
            return is_round & (after_write > batch.target), in_window, is_round
        evicting = after_write >= batch.budget
        return evicting, (batch.budget - after_write) < policy.window_size, evicting


@dataclass
class GenerationStats:
    """What one ``generate`` call did."""

    sequences: int = 0
    tokens_generated: int = 0
    tokens_prefilled: int = 0
    eviction_events: list[int] = field(default_factory=list)  # per sequence
    budgets: list[int] = field(default_factory=list)
    kv_capacity: int = 0  # slots per (sequence, layer, KV head)
    kv_bytes_allocated: int = 0


class _Batched:
    """What ``generate`` records per sequence (by original index) while rows leave the batch: each
    sequence's :class:`Record`, and once it finished, its death record and eviction count."""

    def __init__(self, prompts: Sequence[Sequence[int]], version: int) -> None:
        self.prompt_lens = [len(p) for p in prompts]
        self.records = [Record() for _ in prompts]
        for rec, prompt in zip(self.records, prompts, strict=True):
            rec.append(list(prompt), version)
        self.deaths: list[torch.Tensor | None] = [None] * len(prompts)
        self.events = [0] * len(prompts)  # eviction rounds, once the sequence finished

    def add(
        self,
        seqs: torch.Tensor,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        version: int,
        stop_ids: set[int],
        last: bool,
    ) -> list[int]:
        """Append each row's sampled token; returns the rows that finished (a stop token or ``last``)."""
        done = []
        for row, (seq, tok, lp) in enumerate(
            zip(seqs.tolist(), tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            self.records[seq].append([tok], version, sampled=True, loss=True, logprobs=[lp])
            if tok in stop_ids or last:
                done.append(row)
        return done

    def finish(self, rows: list[int], seqs: torch.Tensor, death: torch.Tensor, events: torch.Tensor) -> None:
        """Keep the finished rows' death record and eviction count (their cache rows go next)."""
        for row in rows:
            seq = int(seqs[row])
            self.deaths[seq] = death[row].clone()
            self.events[seq] = int(events[row])


def _drop_rows(rows: list[int], batch, cache: SlotCache, *per_row: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Remove ``rows`` from the batch and the cache (and from each of ``per_row``, returned)."""
    keep = torch.tensor([r for r in range(len(batch.seq)) if r not in set(rows)], device=batch.seq.device)
    cache.select_rows(keep)
    batch.select(keep)
    return tuple(t.index_select(0, keep) for t in per_row)


class RolloutEngine:
    """Samples batches of sequences from an HF causal LM with a budget-bounded, in-place KV cache.

    >>> engine = RolloutEngine(model, tokenizer, make_policy("snapkv", budget=0.5))
    >>> traces = engine.generate(prompts, SamplingParams(max_new_tokens=256, seed=0))
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        policy: EvictionPolicy | None = None,
        model_name: str = "",
        weights_version: int = 0,
    ) -> None:
        if getattr(model.config, "_attn_implementation", None) != "kvstreams":
            raise KVStreamsError(
                "the model must be loaded with kvstreams.models.load_model (kvstreams attention)"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy or make_policy("full")
        self.model_name = model_name or str(getattr(model.config, "_name_or_path", ""))
        self.shape = model_shape(model)
        self.weights_version = weights_version  # the weights version; every sampled token records it
        self.last_stats = GenerationStats()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        if params.stop_token_ids is not None:
            return set(params.stop_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        return {eos} if eos is not None else set()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights in place (between decode steps: the cache is kept); tokens sampled from now
        on record ``version``."""
        self.model.load_state_dict(state_dict, strict=True)
        self.weights_version = version

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        progress: Callable[[int], None] | None = None,
        on_step: Callable[[int, RolloutEngine], None] | None = None,
    ) -> list[Trace]:
        """Sample one continuation per prompt; returns one :class:`Trace` per prompt, in order.

        ``progress(1)`` is called after every decode step (for progress bars); ``on_step(n, engine)``
        too, where it may call :meth:`update_weights` (asynchronous training).
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise KVStreamsError("every prompt needs at least one token")
        device, G, prompt_lens = self.device, params.max_new_tokens, [len(p) for p in prompts]
        contexts = [p + G for p in prompt_lens]
        schedule = Schedule(self.policy, prompt_lens, contexts, device)
        cache = SlotCache(
            self.shape,
            len(prompts),
            schedule.capacity,
            max(contexts),
            self.model.dtype,
            device,
            self.policy.needs,
        )
        kv_bytes_allocated = cache.kv_bytes  # the peak: rows are only ever removed
        generator = torch.Generator(device=device).manual_seed(params.seed)
        stop_ids = self._stop_ids(params)

        batch, logits, evicting = self._prefill(prompts, schedule, cache, generator)
        events = evicting.long().clone()  # eviction rounds per row so far
        record = _Batched(prompts, self.weights_version)

        for step_no in range(G):
            with _mark("kvstreams::sample"):
                new_tokens, new_lp = sample(logits, params, generator)
            done = record.add(batch.seq, new_tokens, new_lp, self.weights_version, stop_ids, step_no == G - 1)
            if progress is not None:
                progress(1)
            if on_step is not None:  # may update the weights: the next tokens record the new version
                on_step(step_no + 1, self)
            if done:  # finished sequences leave the batch; their record is complete
                record.finish(done, batch.seq, cache.death, events)
                if len(done) == len(batch.seq):
                    break
                new_tokens, events = _drop_rows(done, batch, cache, new_tokens, events)
            logits, evicting = self._decode(new_tokens, step_no + 1, batch, schedule, cache, generator)
            events += evicting.long()

        self.last_stats = GenerationStats(
            sequences=len(prompts),
            tokens_generated=sum(len(r) - p for r, p in zip(record.records, prompt_lens, strict=True)),
            tokens_prefilled=sum(prompt_lens),
            eviction_events=record.events,
            budgets=schedule.budgets,
            kv_capacity=schedule.capacity,
            kv_bytes_allocated=kv_bytes_allocated,
        )
        return [self._trace(record, i, params, schedule.budgets[i]) for i in range(len(prompts))]

    def _prefill(self, prompts, schedule: Schedule, cache: SlotCache, generator):
        """Forward the left-padded prompts (an eviction round where a prompt exceeds its budget); the
        batch's state, the last position's logits and which rows evicted."""
        batch, evicting, window_from = schedule.start([len(p) for p in prompts])
        ids, col_index = self._left_padded(prompts)
        with PrefillStep(self, cache, col_index, batch, evicting, window_from, generator):
            logits = self.model(
                input_ids=ids, position_ids=col_index.clamp(min=0), logits_to_keep=1, use_cache=False
            ).logits[:, -1]
        batch.n_live = torch.where(evicting, batch.target, batch.n_live)
        return batch, logits, evicting

    def _decode(self, new_tokens, step: int, batch, schedule: Schedule, cache: SlotCache, generator):
        """Decode the tokens just sampled: their K/V join the cache, maybe an eviction round follows;
        the next logits and which rows evicted."""
        batch.query_index = batch.query_index + 1
        after_write = batch.n_live + 1
        evicting, in_window, new_window = schedule.decode(batch, step, after_write)
        with DecodeStep(self, cache, batch, evicting, in_window, new_window, generator):
            logits = self.model(
                input_ids=new_tokens[:, None], position_ids=batch.query_index[:, None], use_cache=False
            ).logits[:, -1]
        batch.n_live = torch.where(evicting, batch.target, after_write)
        return logits, evicting

    def _left_padded(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts as one left-padded batch: ids [n, P] and each column's trace index (-1: padding)."""
        device, n, P = self.device, len(prompts), max(len(p) for p in prompts)
        pad_id = getattr(self.tokenizer, "pad_token_id", None) or 0
        ids = torch.full((n, P), pad_id, dtype=torch.long, device=device)
        col_index = torch.full((n, P), -1, dtype=torch.long, device=device)
        for b, prompt in enumerate(prompts):
            ids[b, P - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long, device=device)
            col_index[b, P - len(prompt) :] = torch.arange(len(prompt), device=device)
        return ids, col_index

    def _trace(self, record: _Batched, i: int, params: SamplingParams, budget: int) -> Trace:
        rec, prompt_len, death = record.records[i], record.prompt_lens[i], record.deaths[i]
        assert death is not None
        policy = self.policy
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
                "model": self.model_name,
                "prompt_len": str(prompt_len),
                "seed": str(params.seed),
            },
        )

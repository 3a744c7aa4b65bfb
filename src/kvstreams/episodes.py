"""Multi-turn agent episodes with context compaction, in three modes.

The environment and the model take turns; every message is a *unit* of the episode's context (the
protected head, the model's replies, the environment's answers, compaction instructions and
bridges). When the strategy fires, the oldest live units after the head are deleted:

- ``stream``: the engine evicts their KV entries in place; the episode stays ONE trace whose
  ``death`` record hides the span from then on; nothing is prefilled again.
- ``reprefill``: the standard pipeline; the trace ends and a new one starts from the retained
  tokens (positions from 0), which are prefilled again. An episode becomes several segments.
- ``full``: no compaction (the reference).

With a :class:`~kvstreams.compaction.recall.Recall`, a deleted unit can come back before an
observation joins the context (``stream``: its archived K/V are put back at their positions;
``recompute``, or ``reprefill`` mode: its tokens are fed again as a new unit).

Episodes run in lockstep batches: all of them generate a reply at once (batched decode), then each
gets its environment step; an environment that raises, or an episode that exceeds its limits, ends
that episode with reward 0 and a reason, and the batch goes on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import torch

from kvstreams.chat import ChatFormat
from kvstreams.compaction import Bridge, CompactionStrategy, Reason, UnitKind, UnitView, live_turns
from kvstreams.compaction.recall import Recall, check_mode
from kvstreams.cost import RolloutCost, rollout_cost
from kvstreams.engine.compression import StreamBudget, budget_label
from kvstreams.engine.stream import StreamSession
from kvstreams.envs.base import Environment, checked_messages, checked_step, failure
from kvstreams.errors import KVStreamsError
from kvstreams.policies import EvictionPolicy
from kvstreams.sampling import SamplingParams, sample
from kvstreams.trace import Trace

CompactionMode = Literal["stream", "reprefill", "full"]
COMPACTION_MODES = ("stream", "reprefill", "full")


class Phase(StrEnum):
    """What the reply being written is."""

    ACT = "act"  # an action, handed to the environment
    BRIDGE = "bridge"  # a compaction bridge: the compaction waits for it


@dataclass
class Unit:
    kind: UnitKind
    start: int  # [start, end) in the row's current trace
    end: int
    live: bool = True

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class Deleted:
    """A unit compaction deleted, kept for recall: the unit (its span in the current trace, in stream
    mode) and its tokens."""

    unit: Unit
    tokens: list[int]


@dataclass
class Episode:
    index: int
    seed: int
    env: Environment
    generator: torch.Generator
    units: list[Unit] = field(default_factory=list)
    phase: Phase = Phase.ACT
    bridge_from: int = 0  # where the bridge starts in the current reply unit
    pending: list[int] | None = None  # environment tokens waiting for a compaction to finish
    reason: Reason = Reason.TOKENS  # why the pending compaction fired
    reply: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    turns_since_compaction: int = 0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    compactions: list[dict[str, Any]] = field(default_factory=list)
    segments: list[Trace] = field(default_factory=list)
    first_fill: int = 0  # tokens forwarded before the first compaction
    started: float = field(default_factory=time.perf_counter)
    error: str | None = None
    observations_truncated: int = 0  # observations cut to fit the KV budget (_fit_observation)
    deleted: list[Deleted] = field(default_factory=list)  # what recall may bring back, oldest first
    recalls: list[dict[str, Any]] = field(default_factory=list)  # recall events
    last_reply: str = ""  # the newest reply to the environment (a model-triggered recall's query)

    @property
    def live_tokens(self) -> int:
        return sum(u.length for u in self.units if u.live)


@dataclass
class EpisodeResult:
    episode: int
    seed: int
    reward: float
    traces: list[Trace]  # one in stream/full mode; the segments in reprefill mode
    info: dict[str, Any]
    compactions: list[dict[str, Any]]
    error: str | None = None  # the environment raised (reset or step): the episode is not trained on


class EpisodeRunner:
    def __init__(
        self,
        model,
        tokenizer,
        strategy: CompactionStrategy | None,
        mode: CompactionMode = "stream",
        sampling: SamplingParams | None = None,
        block_size: int = 1,
        max_reply_tokens: int = 64,
        max_episode_tokens: int = 32768,
        episode_timeout_s: float = 600.0,
        model_name: str = "",
        weights_version: int = 0,
        policy: EvictionPolicy | None = None,
        recall: Recall | None = None,
    ) -> None:
        if mode not in COMPACTION_MODES:
            raise KVStreamsError(f"unknown mode {mode!r}; choose one of {', '.join(COMPACTION_MODES)}")
        if mode != "full" and strategy is None:
            raise KVStreamsError(f"mode {mode!r} needs a compaction strategy")
        check_mode(recall, mode)
        if block_size < 1:
            raise KVStreamsError(f"block_size must be >= 1, got {block_size}")
        if max_reply_tokens < 1:
            raise KVStreamsError(f"max_reply_tokens must be >= 1, got {max_reply_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer)
        self.strategy = strategy
        self.mode = mode
        self.policy = policy if policy is not None and policy.evicts() else None  # compression, if any
        if self.policy is not None:
            StreamBudget(self.policy)  # a budget multi-turn streams cannot follow fails here, not mid-batch
        self.sampling = sampling or SamplingParams()
        self.block_size = block_size
        self.max_reply_tokens = max_reply_tokens
        self.max_episode_tokens = max_episode_tokens
        self.episode_timeout_s = episode_timeout_s
        self.model_name = model_name or str(getattr(model.config, "_name_or_path", ""))
        self.weights_version = weights_version  # the weights version the model holds when run() starts
        self.filler = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.chat.end_of_turn
        self.header = self.chat.assistant_header()
        self.marker_tokens: list[int] = []
        if strategy is not None and strategy.bridge == Bridge.MARKER:
            self.marker_tokens = self.chat.encode(strategy.bridge_marker())
        self.recall = recall
        self.session: StreamSession | None = None
        self.tokens_filler = 0

    @property
    def compacting(self) -> bool:
        return self.mode != "full" and self.strategy is not None

    # --- the batch loop ----------------------------------------------------------------------------
    def run(
        self,
        envs: Sequence[Environment],
        seeds: Sequence[int],
        on_step: Callable[[int, StreamSession], None] | None = None,
        progress: Callable[[int], None] | None = None,
        sample_seeds: Sequence[int] | None = None,
    ) -> tuple[list[EpisodeResult], RolloutCost]:
        """Run one episode per (environment, seed), all batched together.

        ``seeds`` seed the environments; ``sample_seeds`` (default: the same) seed each episode's
        sampling, so a GRPO group plays one task with different samples.
        """
        if len(envs) != len(seeds) or not envs:
            raise KVStreamsError("need one seed per environment, and at least one episode")
        sample_seeds = list(seeds) if sample_seeds is None else list(sample_seeds)
        start = time.perf_counter()
        if self.strategy is not None:
            self.strategy = self.strategy.with_token_budget(envs[0].token_budget)
        self.session = StreamSession(
            self.model,
            len(envs),
            weights_version=self.weights_version,
            policy=self.policy,
            seed=self.sampling.seed,
        )
        self.tokens_filler = 0
        episodes = [
            Episode(i, s, env, torch.Generator().manual_seed(self.sampling.seed * 1_000_003 + ss))
            for i, (env, s, ss) in enumerate(zip(envs, seeds, sample_seeds, strict=True))
        ]
        for ep in episodes:
            self._reset(ep)
        # Each round: every active episode writes a reply (batched decode), then each reply is handled
        # (environment step, maybe a compaction), which queues the next tokens to feed.
        active = [ep for ep in episodes if not ep.done]
        step_no = 0
        while active:
            step_no = self._write_replies(active, step_no, on_step, progress)
            for ep in active:
                self._handle_reply(ep)
            active = [ep for ep in active if not ep.done]
        results = [
            EpisodeResult(ep.index, ep.seed, ep.reward, ep.segments, ep.info, ep.compactions, ep.error)
            for ep in episodes
        ]
        return results, self._cost(episodes, time.perf_counter() - start)

    def _reset(self, ep: Episode) -> None:
        """Start an episode: its environment's opening messages become the protected head."""
        try:
            messages = checked_messages(ep.env.reset(ep.seed), "reset")
        except Exception as err:  # an environment failing must not take the batch down
            ep.error = f"seed {ep.seed}: reset raised {type(err).__name__}: {err}"
            self._finish(ep, reason=f"reset raised {type(err).__name__}: {err}")
            return
        head = self.chat.head(messages)
        if self.compacting:
            self.strategy.check(len(head) + self.block_size - 1)  # type: ignore[union-attr]
        self._add_unit(ep, UnitKind.HEAD, head)
        self._start_reply(ep)

    def _write_replies(
        self,
        episodes: list[Episode],
        step_no: int,
        on_step: Callable[[int, StreamSession], None] | None,
        progress: Callable[[int], None] | None,
    ) -> int:
        """Decode one reply per episode, batched: feed what each row has queued (the head or the
        environment's answer, then one sampled token at a time) and sample from what came back, until
        every reply ended (end of turn or its limit). Returns the decode steps taken so far."""
        assert self.session is not None
        session = self.session
        for ep in episodes:
            ep.reply = []
        writing = list(episodes)
        while writing:
            logits = session.forward([ep.index for ep in writing])
            still = []
            for ep, row_logits in zip(writing, logits, strict=True):
                token, logprob = sample(row_logits[None], self.sampling, ep.generator)
                tok = int(token)
                session.append(ep.index, [tok], sampled=True, loss=True, logprobs=[float(logprob)])
                ep.reply.append(tok)
                if tok == self.chat.end_of_turn:
                    continue
                if len(ep.reply) >= self._reply_limit(ep):  # cut off: close the turn for the model
                    session.append(ep.index, [self.chat.end_of_turn])
                    continue
                still.append(ep)
            writing = still
            step_no += 1
            if progress is not None:
                progress(1)
            if on_step is not None:
                on_step(step_no, session)
        return step_no

    def _reply_limit(self, ep: Episode) -> int:
        if ep.phase == Phase.BRIDGE:
            return self.strategy.bridge_limit(self.max_reply_tokens)  # type: ignore[union-attr]
        return self.max_reply_tokens

    # --- units ------------------------------------------------------------------------------------
    def _add_unit(self, ep: Episode, kind: UnitKind, tokens: list[int]) -> Unit:
        assert self.session is not None
        start, end = self.session.append(ep.index, tokens)
        unit = Unit(kind, start, end)
        ep.units.append(unit)
        self._fill(ep, unit)
        return unit

    def _fill(self, ep: Episode, unit: Unit) -> None:
        """Pad the unit to a block boundary (engines with B-token cache blocks evict whole blocks)."""
        assert self.session is not None
        n = -self.session.length(ep.index) % self.block_size
        if n:
            self.session.append(ep.index, [self.filler] * n)
            unit.end += n
            self.tokens_filler += n

    def _start_reply(self, ep: Episode, forced: list[int] | None = None) -> None:
        assert self.session is not None
        start, _ = self.session.append(ep.index, self.header + (forced or []))
        ep.units.append(Unit(UnitKind.ASSISTANT, start, start))  # grows as the model writes
        ep.bridge_from = start if not forced else start + len(self.header) + len(forced)

    def _close_reply(self, ep: Episode) -> Unit:
        assert self.session is not None
        unit = ep.units[-1]
        unit.end = self.session.length(ep.index)
        self._fill(ep, unit)
        return unit

    # --- one reply ----------------------------------------------------------------------------------
    def _handle_reply(self, ep: Episode) -> None:
        """A reply is written: finish a pending compaction with it (a bridge), compact if the model
        wrote its marker, or hand it to the environment and queue the answer."""
        reply = self._close_reply(ep)
        if ep.phase == Phase.BRIDGE:
            self._compact(ep, reason=ep.reason, bridge_from=ep.bridge_from)
            ep.phase = Phase.ACT
            self._continue(ep, ep.pending or [])
            ep.pending = None
            return
        if self.mode != "full" and self.marker_tokens:
            marker_end = self._marker_end(ep, reply)
            if marker_end is not None:  # the model decided to compact: this reply is a bridge
                self._compact(ep, reason=Reason.MODEL, bridge_from=marker_end)
                self._start_reply(ep)
                return
        if self.recall is not None and self.recall.trigger == "model":
            ep.last_reply = self.chat.decode(self.session.tokens(ep.index, reply.start, reply.end))
        messages = self._step_env(ep)
        if messages is None:
            return
        incoming = self._fit_observation(ep, messages)
        if self.compacting and self._maybe_compact(ep, incoming):
            return  # a bridge is asked for first; the answer waits in ep.pending
        self._continue(ep, incoming)

    def _step_env(self, ep: Episode) -> list | None:
        """Hand the reply to the environment; its answer's messages, or None when the episode ended."""
        assert self.session is not None
        text = self.chat.decode([t for t in ep.reply if t != self.chat.end_of_turn])
        try:  # what the environment returns is checked inside the guard: a bad answer drops the episode
            messages, reward, done, info = checked_step(ep.env, ep.env.step(text), ep.reward)
        except Exception as err:
            ep.error = f"seed {ep.seed}: {failure(err)}"
            self._finish(ep, reason=failure(err), failed=True)
            return None
        ep.reward += reward
        ep.turns += 1
        ep.turns_since_compaction += 1
        ep.info.update(info)
        if done:
            self._finish(ep, reason="done")
        elif ep.turns >= ep.env.max_turns:
            self._finish(ep, reason="max_turns")
        elif self.session.length(ep.index) > self.max_episode_tokens:
            self._finish(ep, reason="max_episode_tokens", failed=True)
        elif time.perf_counter() - ep.started > self.episode_timeout_s:
            self._finish(ep, reason="timeout", failed=True)
        return None if ep.done else messages

    def _maybe_compact(self, ep: Episode, incoming: list[int]) -> bool:
        """Compact before ``incoming`` joins the context if the strategy's trigger fires. Returns True
        when a bridge must be written first (the compaction then finishes in :meth:`_handle_reply`)."""
        strategy = self.strategy
        assert strategy is not None
        need = len(incoming) + len(self.header) + 2 * (self.block_size - 1)
        live = [u for u in ep.units if u.live]
        turns = live_turns([UnitView(u.kind, u.length) for u in live])
        reason = strategy.when.fires(ep.live_tokens, need, ep.turns_since_compaction, turns)
        if reason is None:
            return False
        if strategy.bridge is not None:
            ep.phase, ep.pending, ep.reason = Phase.BRIDGE, incoming, reason
            if strategy.bridge == Bridge.INSTRUCTION:
                request = self.chat.after_reply([{"role": "user", "content": strategy.bridge_request()}])
                self._add_unit(ep, UnitKind.INSTRUCTION, request)
                self._start_reply(ep)
            else:  # the model did not compact in time: write its marker for it
                self._start_reply(ep, forced=self.marker_tokens)
            return True
        head = sum(u.length for u in live if u.kind == UnitKind.HEAD)
        views = [UnitView(u.kind, u.length) for u in live if u.kind != UnitKind.HEAD]
        self._compact(ep, reason=reason, n_delete=strategy.deletion(head, views, need, reason))
        return False

    def _fit_observation(self, ep: Episode, messages: list) -> list[int]:
        """The environment's answer as tokens, cut to fit the KV budget. The rule: an observation never
        takes more than the budget minus what every compaction keeps (the protected head and the
        newest reply) and the room the next reply's header needs; compaction can then always make
        room for it, and the live context stays within B plus one reply, as with short observations.
        A longer one keeps its beginning and ends with ``[truncated]``. Counted per episode
        (``observations_truncated``) and per batch (``RolloutCost``, ``rollout/observations_truncated``)."""
        incoming = self.chat.after_reply(messages)
        if not self.compacting or not messages:
            return incoming
        head = sum(u.length for u in ep.units if u.kind == UnitKind.HEAD)
        newest_reply = len(self.header) + self.max_reply_tokens + 1  # + its end-of-turn token
        cap = self.strategy.token_budget_in_force - head  # type: ignore[union-attr]
        cap -= newest_reply + len(self.header) + 2 * (self.block_size - 1)
        if len(incoming) <= cap:
            return incoming
        last = messages[-1]
        content = self.chat.encode(last["content"])
        keep = len(content) - (len(incoming) - cap)
        while keep > 0:
            cut = {**last, "content": self.chat.decode(content[:keep]) + " [truncated]"}
            incoming = self.chat.after_reply([*messages[:-1], cut])
            if len(incoming) <= cap:
                break
            keep -= max(1, len(incoming) - cap)
        ep.observations_truncated += 1
        return incoming

    def _continue(self, ep: Episode, incoming: list[int]) -> None:
        if incoming:
            if self.recall is not None:
                self._recall(ep, incoming)
            self._add_unit(ep, UnitKind.ENV, incoming)
        self._start_reply(ep)

    def _recall(self, ep: Episode, incoming: list[int]) -> None:
        """Bring back the deleted units the recall chooses for the observation ``incoming`` (or for
        the query the last reply wrote, trigger "model"): their archived K/V (``archive``: the unit is
        live again where it was) or their tokens fed again as a new unit (``recompute``)."""
        assert self.session is not None and self.recall is not None
        query = self.recall.query(self.chat.decode(incoming), ep.last_reply)
        ep.last_reply = ""  # a query is answered once
        if query is None:
            return
        candidates = [d for d in ep.deleted if len(d.tokens) <= self.recall.max_tokens]
        texts = [self.recall.content(self.chat.decode(d.tokens)) for d in candidates]
        for i in self.recall.choose(texts, query):
            d = candidates[i]
            ep.deleted.remove(d)
            if self.recall.how == "archive":
                self.session.recall(ep.index, d.unit.start, d.unit.end)
                d.unit.live, span = True, [d.unit.start, d.unit.end]
            else:
                unit = self._add_unit(ep, d.unit.kind, d.tokens)
                span = [unit.start, unit.end]
            event = {"step": ep.turns, "span": span, "tokens": len(d.tokens), "how": self.recall.how}
            ep.recalls.append(event | ({"query": query} if self.recall.trigger == "model" else {}))

    def _marker_end(self, ep: Episode, reply: Unit) -> int | None:
        """Trace index right after the marker in the reply, if the model wrote one."""
        marker = self.strategy.bridge_marker()  # type: ignore[union-attr]
        tokens = ep.reply
        if marker not in self.chat.decode(tokens):
            return None
        for i in range(1, len(tokens) + 1):
            if marker in self.chat.decode(tokens[:i]):
                return reply.start + len(self.header) + i
        return None

    # --- compaction ---------------------------------------------------------------------------------
    def _compact(
        self, ep: Episode, reason: Reason, n_delete: int = 0, bridge_from: int | None = None
    ) -> None:
        """Delete the oldest live units after the head (:meth:`_doomed`), record the event, and apply it:
        evict in place (stream) or end the trace and start a new one from what is kept (re-prefill)."""
        assert self.session is not None and self.strategy is not None
        session, row = self.session, ep.index
        live_before = ep.live_tokens  # the context at its peak: B in the closed form N * r / (B - r)
        if not ep.compactions:
            ep.first_fill = session.fed(row)
        doomed, bridge = self._doomed(ep, reason, n_delete, bridge_from)
        deleted = [[u.start, u.end] for u in doomed]
        for u in doomed:
            u.live = False
        event: dict[str, Any] = {
            "kind": self.strategy.name,
            "trigger": reason,
            "step": ep.turns,
            "deleted": deleted,
            "bridge": [bridge.start, bridge.end] if bridge else None,
            "live_before": live_before,
        }
        if self.recall is not None:  # what recall may bring back (read before re-prefill drops it)
            ep.deleted += [Deleted(u, session.tokens(row, u.start, u.end)) for u in doomed if u.length > 0]
        if self.mode == "stream":
            archive = self.recall is not None and self.recall.how == "archive"
            session.delete(row, [(start, end) for start, end in deleted], archive=archive)
            event["retained"] = ep.live_tokens
        else:
            self._restart_from_kept(ep, event)
        ep.compactions.append(event)
        ep.turns_since_compaction = 0

    def _doomed(
        self, ep: Episode, reason: Reason, n_delete: int, bridge_from: int | None
    ) -> tuple[list[Unit], Unit | None]:
        """The units a compaction deletes: the oldest ``n_delete`` live ones after the head, or, with a
        bridge, everything before ``bridge_from`` that the strategy lets go (the reply unit holding the
        bridge is split: the bridge becomes a unit of its own). Returns them and the bridge unit."""
        assert self.strategy is not None
        live = [u for u in ep.units if u.live and u.kind != UnitKind.HEAD]
        if bridge_from is None:
            return live[:n_delete], None
        last = ep.units[-1]
        bridge = Unit(UnitKind.BRIDGE, bridge_from, last.end)
        last.end = bridge_from
        ep.units.append(bridge)
        # the instruction and the reply's part before the bridge always go; of the older units, the
        # strategy decides (all of them, or the oldest turns after a turn trigger)
        older = [u for u in live if u is not last and u.kind != UnitKind.INSTRUCTION]
        head = sum(u.length for u in ep.units if u.live and u.kind == UnitKind.HEAD)
        n = self.strategy.deletion(head, [UnitView(u.kind, u.length) for u in older], 0, reason)
        kept = {id(u) for u in older[n:]}
        return [u for u in live if u.length > 0 and id(u) not in kept], bridge

    def _restart_from_kept(self, ep: Episode, event: dict[str, Any]) -> None:
        """Re-prefill: this trace ends (a segment, carrying the event); a new one starts from the kept
        units' tokens, with positions from 0, which the next forward prefills again."""
        assert self.session is not None
        kept = [u for u in ep.units if u.live and u.length > 0]
        retained = [t for u in kept for t in self.session.tokens(ep.index, u.start, u.end)]
        event["retained"] = len(retained)
        ep.segments.append(self.session.restart(ep.index, retained, self._meta(ep, events=[event])))
        offset = 0
        for u in kept:
            u.start, u.end, offset = offset, offset + u.length, offset + u.length
        ep.units = kept

    # --- endings --------------------------------------------------------------------------------
    def _finish(self, ep: Episode, reason: str, failed: bool = False) -> None:
        ep.done = True
        ep.info["end"] = reason
        if failed or reason.startswith("reset"):
            ep.reward = 0.0
        if self.session is not None and self.session.length(ep.index) > 0:
            events = ep.compactions if self.mode == "stream" else []
            ep.segments.append(self.session.trace(ep.index, self._meta(ep, events=events)))

    def _meta(self, ep: Episode, events: list[dict[str, Any]]) -> dict[str, str]:
        return {
            "temperature": str(self.sampling.temperature),
            "top_p": str(self.sampling.top_p),
            "top_k": str(self.sampling.top_k),
            "policy": self.policy.name if self.policy is not None else "full",
            **self._policy_meta(),
            "mode": self.mode,
            "model": self.model_name,
            "env": ep.env.name,
            "strategy": self.strategy.name if self.strategy is not None else "none",
            "strategy_config": json.dumps(self.strategy.describe() if self.strategy is not None else {}),
            "episode": str(ep.index),
            "seed": str(ep.seed),
            "segment": str(len(ep.segments)),
            "block_size": str(self.block_size),
            "events": json.dumps(events),
            **self._recall_meta(ep),
        }

    def _recall_meta(self, ep: Episode) -> dict[str, str]:
        """The recall's settings and the episode's recall events so far, on traces of recalling runs."""
        if self.recall is None:
            return {}
        return {"recall": json.dumps(self.recall.describe()), "recall_events": json.dumps(ep.recalls)}

    def _policy_meta(self) -> dict[str, str]:
        """The compression's settings, on traces of compressed episodes only."""
        if self.policy is None:
            return {}
        return {"policy_config": json.dumps(self.policy.describe()), "budget": budget_label(self.policy)}

    def _cost(self, episodes: list[Episode], seconds: float) -> RolloutCost:
        assert self.session is not None
        return rollout_cost(
            self.session.counters,
            rewards=[ep.reward for ep in episodes],
            events=[e for ep in episodes for e in ep.compactions],
            first_fill=sum(ep.first_fill for ep in episodes if ep.compactions),
            tokens_filler=self.tokens_filler,
            tokens_trace=sum(len(t) for ep in episodes for t in ep.segments),
            seconds=round(seconds, 3),
            observations_truncated=sum(ep.observations_truncated for ep in episodes),
            recalls=sum(len(ep.recalls) for ep in episodes),
            tokens_recalled=sum(e["tokens"] for ep in episodes for e in ep.recalls),
        )

"""Multi-turn episodes with compaction: exact replay in stream mode, re-prefill accounting, the three
modes agreeing before the first compaction, block padding, weight updates, failing environments."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvstreams.compaction import STRATEGIES, make_strategy
from kvstreams.cost import reprefill_closed_form
from kvstreams.engine import SamplingParams
from kvstreams.envs import Environment, StepResult, make_env
from kvstreams.episodes import EpisodeRunner
from kvstreams.errors import KVStreamsError
from kvstreams.replay import replay_logprobs
from kvstreams.verify import Agreement


def run(qwen, strategy: str | None, mode: str, n: int = 2, env_kwargs=None, **options):
    model, tok = qwen
    runner = EpisodeRunner(
        model,
        tok,
        make_strategy(strategy) if strategy else None,
        mode=mode,
        sampling=SamplingParams(seed=0),
        **options,
    )
    envs = [make_env("memory", **(env_kwargs or {})) for _ in range(n)]
    return runner.run(envs, list(range(1, n + 1)))


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_stream_mode_replays_exactly_and_never_reprefills(qwen, strategy):
    results, stats = run(qwen, strategy, "stream")
    traces = [t for r in results for t in r.traces]
    assert len(traces) == len(results)  # one trace per episode
    assert all(len(r.compactions) >= 3 for r in results)
    assert stats.tokens_reprefilled == 0
    assert stats.tokens_forwarded <= stats.tokens_trace  # every token entered the cache at most once
    agreement = Agreement.measure(traces, replay_logprobs(qwen[0], traces))
    assert agreement.max_abs_diff <= 1e-4
    dense = Agreement.measure(traces, replay_logprobs(qwen[0], traces, mode="dense"))
    assert dense.max_abs_diff > 0.05

    for r, trace in zip(results, traces, strict=True):
        death = trace.death[0, 0]
        assert tuple(trace.death.shape[:2]) == (1, 1)  # compaction evicts in every layer and head alike
        for event in r.compactions:
            spans = event["deleted"]
            assert spans, event
            at = {int(death[s:e].max()) for s, e in spans if e > s} | {
                int(death[s:e].min()) for s, e in spans if e > s
            }
            assert len(at) == 1  # the whole span dies at one query ...
            (at,) = at
            assert at > max(e for _, e in spans) - 1  # ... after it was written
            if event["bridge"]:
                b0, b1 = event["bridge"]
                assert b0 >= max(e for _, e in spans) and bool((death[b0:b1] > at).all())  # the bridge stays
        # the protected head is never evicted
        head_end = min(s for e in r.compactions for s, _ in e["deleted"])
        assert bool((death[:head_end] == len(trace)).all())
        assert trace.metadata["mode"] == "stream" and trace.metadata["strategy"] == strategy


@pytest.mark.parametrize(
    ("strategy", "first_at", "spans"),
    [("sliding_window", 10, 2), ("markovian", 10, 10), ("summary", 8, 11)],
)
def test_kvstreams_presets_are_turn_triggered(qwen, strategy, first_at, spans):
    """The KV-streams authors' settings: sliding window keeps at most 10 turns, dropping the oldest
    (2 units: the reply and its answer); Markovian drops 5 of 10; summary replaces the 5 oldest of 8
    turns (10 units, plus its instruction) with a bridge. Replay stays exact."""
    model, tok = qwen
    options = {"max_bridge_tokens": 12} if strategy == "summary" else {}  # a random model writes to the limit
    chosen = make_strategy(strategy, preset="kvstreams", **options)
    assert chosen.token_budget == 32768 and chosen.max_turns == first_at
    runner = EpisodeRunner(
        model, tok, chosen, mode="stream", sampling=SamplingParams(seed=0), max_reply_tokens=8
    )
    results, _ = runner.run([make_env("memory", n_turns=15, max_turns=17) for _ in range(2)], [1, 2])
    for r in results:
        assert len(r.compactions) >= 2 and all(e["trigger"] == "turns" for e in r.compactions)
        assert r.compactions[0]["step"] == first_at  # the first fires when the context holds that many turns
        assert len(r.compactions[0]["deleted"]) == spans
        if strategy == "sliding_window":
            assert [e["step"] for e in r.compactions] == list(range(10, 10 + len(r.compactions)))
        if strategy == "markovian":
            assert r.compactions[1]["step"] == 15  # 5 turns stayed, 5 more came
    traces = [t for r in results for t in r.traces]
    assert Agreement.measure(traces, replay_logprobs(model, traces)).max_abs_diff <= 1e-4
    with pytest.raises(KVStreamsError, match="no preset"):
        make_strategy(strategy, preset="nope")


@pytest.mark.parametrize("strategy", ["sliding_window", "summary"])
def test_reprefill_segments_replay_exactly_and_are_counted(qwen, strategy):
    results, stats = run(qwen, strategy, "reprefill")
    for r in results:
        assert len(r.traces) == len(r.compactions) + 1
        for k, seg in enumerate(r.traces):
            assert int(seg.metadata["segment"]) == k
            assert int(seg.death.min()) == len(seg)  # nothing is evicted inside a segment
    assert stats.tokens_reprefilled == sum(e["retained"] for r in results for e in r.compactions) > 0
    traces = [t for r in results for t in r.traces]
    assert Agreement.measure(traces, replay_logprobs(qwen[0], traces)).max_abs_diff <= 1e-4


def test_reprefill_cost_matches_the_closed_form_on_a_long_episode(qwen):
    _, stats = run(qwen, "sliding_window", "reprefill", n=1, env_kwargs={"n_turns": 40, "max_turns": 60})
    assert stats.compactions >= 20
    new_tokens = stats.tokens_forwarded - stats.tokens_reprefilled
    predicted = reprefill_closed_form(new_tokens, stats.retained_mean, stats.context_at_compaction_mean)
    assert predicted == pytest.approx(stats.tokens_reprefilled_predicted)
    assert abs(stats.tokens_reprefilled / predicted - 1) < 0.10
    # the first fill (0 -> B) re-prefills nothing: the steady-state form leaves it out
    assert 0 < stats.tokens_first_fill < 2 * stats.context_at_compaction_mean
    steady = reprefill_closed_form(
        new_tokens - stats.tokens_first_fill, stats.retained_mean, stats.context_at_compaction_mean
    )
    assert steady == pytest.approx(stats.tokens_reprefilled_predicted_steady)
    assert abs(stats.tokens_reprefilled / steady - 1) < 0.10


def test_closed_form_rejects_r_at_or_above_b():
    assert reprefill_closed_form(1000, 100, 300) == pytest.approx(500)
    with pytest.raises(KVStreamsError, match="diverges"):
        reprefill_closed_form(1000, 300, 300)


@pytest.mark.parametrize("strategy", ["sliding_window", "markovian"])
def test_same_seed_same_text_in_all_modes_until_the_first_compaction(qwen, strategy):
    stream, _ = run(qwen, strategy, "stream")
    reprefill, _ = run(qwen, strategy, "reprefill")
    full, _ = run(qwen, None, "full")
    for s, r, f in zip(stream, reprefill, full, strict=True):
        first = r.traces[0]  # the segment that ends at the first compaction
        n = len(first)
        assert torch.equal(s.traces[0].tokens[:n], first.tokens)
        assert torch.equal(f.traces[0].tokens[:n], first.tokens)
        assert torch.allclose(
            s.traces[0].sampler_logprobs[:n].nan_to_num(), first.sampler_logprobs.nan_to_num(), atol=1e-5
        )
        assert not torch.equal(
            s.traces[0].tokens, f.traces[0].tokens
        )  # compaction did change what came after


def test_full_mode_never_compacts_and_its_kv_grows(qwen):
    _, full = run(qwen, None, "full")
    _, stream = run(qwen, "markovian", "stream")
    assert full.compactions == 0 and full.tokens_reprefilled == 0
    assert stream.kv_peak_entries < full.kv_peak_entries / 2


def test_block_padding_aligns_every_turn(qwen):
    results, stats = run(qwen, "sliding_window", "stream", block_size=16)
    assert stats.tokens_filler > 0
    for r in results:
        for event in r.compactions:
            for start, end in event["deleted"]:
                assert start % 16 == 0 and end % 16 == 0
    traces = [t for r in results for t in r.traces]
    assert Agreement.measure(traces, replay_logprobs(qwen[0], traces)).max_abs_diff <= 1e-4


def test_weight_update_mid_episode_keeps_the_cache(qwen):
    model, tok = qwen
    original = {k: v.clone() for k, v in model.state_dict().items()}
    perturbed = {
        k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()
    }

    def on_step(step: int, session) -> None:
        if step == 30:
            session.update_weights(perturbed, version=1)

    runner = EpisodeRunner(
        model, tok, make_strategy("markovian"), mode="stream", sampling=SamplingParams(seed=0)
    )
    try:
        results, stats = runner.run([make_env("memory") for _ in range(2)], [1, 2], on_step=on_step)
    finally:
        model.load_state_dict(original)
    for r in results:
        (trace,) = r.traces
        versions = trace.weights_version
        assert set(versions.tolist()) == {0, 1}
        first_new = int((versions == 1).nonzero()[0])
        assert bool((versions[first_new:] == 1).all())  # monotone: old tokens keep their version
    assert stats.tokens_reprefilled == 0  # nothing was flushed or recomputed
    assert stats.tokens_forwarded <= stats.tokens_trace


@dataclass
class Flaky(Environment):
    fail_on: str = "step"

    def reset(self, seed: int):
        if self.fail_on == "reset":
            raise RuntimeError("cannot start")
        self.turn = 0
        return [{"role": "user", "content": "Say anything."}]

    def step(self, reply: str) -> StepResult:
        self.turn += 1
        if self.fail_on == "step" and self.turn == 2:
            raise ValueError("broken game")
        return StepResult(
            [{"role": "user", "content": "more"}], 0.5 if self.turn == 3 else 0.0, self.turn == 3, {}
        )


def test_failing_environments_end_their_episode_only(qwen):
    model, tok = qwen
    runner = EpisodeRunner(model, tok, None, mode="full", sampling=SamplingParams(seed=0), max_reply_tokens=8)
    results, _ = runner.run([Flaky(fail_on="step"), Flaky(fail_on="reset"), Flaky(fail_on="")], [0, 1, 2])
    step_fail, reset_fail, ok = results
    assert step_fail.reward == 0 and "step raised ValueError: broken game" in step_fail.info["end"]
    assert len(step_fail.traces) == 1  # what was sampled before the failure is kept
    assert (
        reset_fail.reward == 0
        and reset_fail.info["end"].startswith("reset raised")
        and reset_fail.traces == []
    )
    assert ok.reward == 0.5 and ok.info["end"] == "done"


def test_budget_that_cannot_hold_the_head_is_rejected(qwen):
    model, tok = qwen
    runner = EpisodeRunner(model, tok, make_strategy("sliding_window", token_budget=40), mode="stream")
    with pytest.raises(KVStreamsError, match="not below the budget"):
        runner.run([make_env("memory")], [0])
    with pytest.raises(KVStreamsError, match="keep_tokens"):
        make_strategy("markovian", token_budget=100, keep_tokens=100)
    with pytest.raises(KVStreamsError, match="unknown compaction strategy"):
        make_strategy("nope")


@dataclass
class Flood(Environment):
    """Short observations, except one far larger than the KV budget."""

    def reset(self, seed: int):
        self.turn = 0
        return [{"role": "user", "content": "Say anything."}]

    def step(self, reply: str) -> StepResult:
        self.turn += 1
        words = 2000 if self.turn == 2 else 8
        text = " ".join(["word"] * words) + " END"
        return StepResult([{"role": "user", "content": text}], 0.0, self.turn == 5, {})


def test_an_observation_larger_than_the_budget_is_truncated_and_counted(qwen):
    """The KV budget is a promise: the live context stays within B plus one reply even when an
    environment answers with far more than B tokens (before, one such answer took the peak to 22x B)."""
    model, tok = qwen
    budget, reply = 128, 8
    strategy = make_strategy("sliding_window", token_budget=budget)
    runner = EpisodeRunner(
        model, tok, strategy, mode="stream", sampling=SamplingParams(seed=0), max_reply_tokens=reply
    )
    results, stats = runner.run([Flood(), Flood()], [0, 1])
    assert stats.observations_truncated == 2  # one per episode
    assert stats.kv_peak_entries <= budget + reply + 1  # as with short observations
    text = tok.decode(results[0].traces[0].tokens.tolist())
    assert "[truncated]" in text and text.count("END") == 3  # 4 observations: the long one lost its end


def test_the_old_name_of_the_token_budget_still_works_and_warns():
    """B was ``budget`` before "budget" came to mean a policy's KV budget only: the old key is read as
    ``token_budget`` everywhere a user may still write it (strategy options, configs, checkpointed
    configs on resume), with a warning where the user wrote it."""
    from kvstreams.train.checkpoint import config_changes
    from kvstreams.train.config import load_config

    with pytest.warns(FutureWarning, match="token_budget"):
        strategy = make_strategy("sliding_window", budget=64)
    assert strategy.token_budget == 64
    with pytest.warns(FutureWarning, match="token_budget"):
        cfg = load_config(None, ["rollout.strategy_args={budget = 96}"])
    assert cfg.rollout.strategy_args == {"token_budget": 96}
    old = cfg.model_dump()
    old["rollout"]["strategy_args"] = {"budget": 96}  # a checkpoint written before the rename
    assert config_changes(old, cfg.model_dump()) == {}
    old["rollout"]["strategy_args"] = {"budget": 97}
    assert config_changes(old, cfg.model_dump()) == {
        "rollout.strategy_args": [{"token_budget": 97}, {"token_budget": 96}]
    }

"""Compression inside multi-turn episodes: an eviction policy under its budget while a compaction
strategy deletes spans (or alone), in one stream, replayed exactly by the unchanged learner."""

from __future__ import annotations

import pytest
import torch

from kvstreams.compaction import STRATEGIES, make_strategy
from kvstreams.engine import SamplingParams
from kvstreams.engine.compression import StreamBudget
from kvstreams.envs import make_env
from kvstreams.episodes import EpisodeRunner
from kvstreams.errors import KVStreamsError
from kvstreams.policies import POLICIES, make_policy
from kvstreams.replay import replay_logprobs
from kvstreams.train.config import load_config
from kvstreams.train.rollouts import RolloutSource
from kvstreams.verify import Agreement
from test_episodes import run as run_episodes

BUDGET = 48  # entries per layer and KV head: well below what the compaction strategies keep live
SCORED = {"h2o", "knorm", "random", "snapkv"}  # policies whose choices differ between heads


def episodes(qwen, strategy: str | None, policy: str, mode: str = "stream", budget=BUDGET, n: int = 2):
    """test_episodes' episodes (memory, seeds 1..n, sampling seed 0) with ``policy`` compressing."""
    return run_episodes(qwen, strategy, mode, n=n, policy=make_policy(policy, budget=budget, interval=4))


def assert_exact(model, traces) -> None:
    shadow = Agreement.measure(traces, replay_logprobs(model, traces))
    assert shadow.max_abs_diff <= 1e-4
    dense = Agreement.measure(traces, replay_logprobs(model, traces, mode="dense"))
    assert dense.max_abs_diff > 0.05  # the record matters: a plain causal learner is far off


def pairs():
    """Every policy inside one strategy, and one policy inside every strategy (every pair: verify)."""
    policies = sorted(p for p in POLICIES if p != "full")
    return [("markovian", p) for p in policies] + [
        (s, "snapkv") for s in sorted(STRATEGIES) if s != "markovian"
    ]


@pytest.mark.parametrize(("strategy", "policy"), pairs())
def test_compression_inside_compaction_replays_exactly(qwen, strategy, policy):
    results, stats = episodes(qwen, strategy, policy, n=1)
    traces = [t for r in results for t in r.traces]
    assert len(traces) == len(results) and all(len(r.compactions) >= 3 for r in results)
    assert_exact(qwen[0], traces)
    # the KV held between forwards stays under the budget, whatever the compaction keeps live
    assert stats.kv_peak_entries < BUDGET
    for r, trace in zip(results, traces, strict=True):
        assert trace.metadata["policy"] == policy and trace.metadata["strategy"] == strategy
        assert trace.metadata["budget"] == str(BUDGET)
        per_head = tuple(trace.death.shape[:2]) != (1, 1)
        assert per_head == (policy in SCORED)  # compaction alone is the same in every layer and head
        n = len(trace)
        dead = trace.death < n
        # compression evicted entries that compaction never touched: dead before any compaction
        first = min(int(trace.death[..., s:e].max()) for e_ in r.compactions for s, e in e_["deleted"])
        assert bool((trace.death < first).any())
        # every span compaction deleted is dead by then (in every layer and head)
        for event in r.compactions:
            for s, e in event["deleted"]:
                assert bool(dead[..., s:e].all())


def test_compression_without_compaction_bounds_the_kv_and_replays_exactly(qwen):
    results, stats = episodes(qwen, None, "h2o", mode="full")
    traces = [t for r in results for t in r.traces]
    assert stats.kv_peak_entries < BUDGET and all(not r.compactions for r in results)
    assert all(len(t) > 4 * BUDGET for t in traces)
    assert_exact(qwen[0], traces)


def test_reprefill_segments_under_compression_replay_exactly(qwen):
    results, stats = episodes(qwen, "markovian", "snapkv", mode="reprefill")
    traces = [t for r in results for t in r.traces]
    assert len(traces) > len(results) and stats.tokens_reprefilled > 0  # segments, re-prefilled
    assert_exact(qwen[0], traces)


def test_a_per_sequence_share_keeps_that_share_of_the_stream(qwen):
    results, _ = episodes(qwen, "markovian", "knorm", budget=0.5)
    traces = [t for r in results for t in r.traces]
    assert_exact(qwen[0], traces)
    for t in traces:  # at the end, about half of what was fed and not compacted is still live
        assert 0 < int((t.death[0, 0] == len(t)).sum()) <= len(t) // 2 + 4


def test_no_policy_leaves_the_stream_untouched(qwen):
    """Compression off is compaction alone: the same traces whether or not a policy that evicts
    nothing is passed (the runner drops it)."""
    model, tok = qwen
    out = []
    for policy in (None, make_policy("full")):
        runner = EpisodeRunner(
            model, tok, make_strategy("markovian"), sampling=SamplingParams(seed=0), policy=policy
        )
        results, _ = runner.run([make_env("memory")], [1])
        out.append(results[0].traces[0])
    a, b = out
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.death, b.death)
    assert "policy_config" not in a.metadata and a.metadata["policy"] == "full"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": 0.5, "budget_of": "context"}, "budget_of = 'context'"),
        ({"budget": 1.0}, "keeps everything"),
        ({"budget": 8, "interval": 8}, "too small"),
    ],
)
def test_budgets_a_stream_cannot_follow_are_refused_before_sampling(kwargs, message):
    with pytest.raises(KVStreamsError, match=message):
        StreamBudget(make_policy("snapkv", **kwargs))


def test_training_rollouts_compress_inside_compaction(qwen, model_dirs, tmp_path):
    from test_train import learner_step_then_restore, small_config

    model, tok = qwen
    sets = {"rollout.policy": '"snapkv"', "rollout.policy_args": "{budget = 40, interval = 4}"}
    cfg = small_config(model_dirs["qwen3"], tmp_path, **sets)
    batch = RolloutSource(model, tok, cfg).collect(step=0)
    assert batch.stats.compactions > 0
    assert all(s.trace.metadata["policy"] == "snapkv" for s in batch.samples)
    metrics = learner_step_then_restore(model, cfg, batch)
    assert metrics["ratio/first_update_max_abs_dev"] < 1e-4  # the learner saw what the sampler saw
    assert metrics["mismatch/k3_kl"] < 1e-9


def test_a_bad_budget_is_a_config_error():
    with pytest.raises(KVStreamsError, match="budget_of = 'context'"):
        load_config(
            None,
            [
                'rollout.strategy="markovian"',
                'rollout.policy="snapkv"',
                'rollout.policy_args={budget = 0.5, budget_of = "context"}',
            ],
        )


def test_a_budget_that_never_binds_gives_the_traces_of_compaction_alone(qwen):
    """The compressing path (rows always explicit, a round plan per forward) samples exactly what
    compaction alone samples when no round fires: same tokens, log-probs and death record."""
    model, tok = qwen
    out = []
    for policy in (None, make_policy("recent", budget=100_000)):
        runner = EpisodeRunner(
            model, tok, make_strategy("markovian"), sampling=SamplingParams(seed=0), policy=policy
        )
        results, _ = runner.run([make_env("memory") for _ in range(2)], [1, 2])
        out.append([t for r in results for t in r.traces])
    for a, b in zip(*out, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.death, b.death)
        assert torch.equal(a.sampler_logprobs.nan_to_num(), b.sampler_logprobs.nan_to_num())
        assert b.metadata["policy"] == "recent" and b.n_evicted == a.n_evicted

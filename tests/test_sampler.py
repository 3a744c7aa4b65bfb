"""The one door to sampling: a config's rollout section becomes one SamplerSpec, and sample_episodes
runs single-turn and multi-turn environments alike."""

from __future__ import annotations

from kvstreams.envs import make_env
from kvstreams.sampler import SamplerSpec, sample_episodes
from kvstreams.sampling import SamplingParams
from kvstreams.train.config import load_config


def rollout(model_dir, tmp_path, *sets):
    base = [f'model.path="{model_dir}"', f'train.out_dir="{tmp_path}"']
    return load_config(None, [*base, *sets]).rollout


def test_the_spec_builds_only_what_the_mode_uses(model_dirs, tmp_path):
    r = rollout(model_dirs["qwen3"], tmp_path, 'rollout.recall="lexical"', 'rollout.policy="h2o"')
    stream = SamplerSpec.from_rollout(r)
    assert (
        stream.strategy.name == "markovian"
        and stream.recall.name == "lexical"
        and stream.policy.name == "h2o"
    )
    full = SamplerSpec.from_rollout(r, mode="full")  # e.g. an evaluation in full context
    assert full.strategy is None and full.recall is None and full.policy.name == "h2o"
    single = SamplerSpec.from_rollout(rollout(model_dirs["qwen3"], tmp_path, 'rollout.env="recall"'))
    assert single.single_turn and single.strategy is None


def test_single_and_multi_turn_episodes_come_back_the_same_way(qwen):
    params = SamplingParams(max_new_tokens=8, seed=0)
    for env, spec in (
        ("recall", SamplerSpec("recall")),
        ("memory", SamplerSpec("memory", max_reply_tokens=8)),
    ):
        envs = [make_env(env, **({"n_turns": 2} if env == "memory" else {})) for _ in range(3)]
        results, cost = sample_episodes(*qwen, spec, envs, [5, 6, 7], params)
        assert [r.episode for r in results] == [0, 1, 2] and [r.seed for r in results] == [5, 6, 7]
        assert all(len(r.traces) == 1 and r.error is None for r in results)
        assert cost.episodes == 3 and cost.tokens_trace == sum(len(r.traces[0]) for r in results)
        assert cost.reward_mean == sum(r.reward for r in results) / 3


def test_a_single_turn_environment_that_raises_scores_zero_and_says_why(qwen):
    class Broken:
        name = "recall"

        def reset(self, seed):
            return [{"role": "user", "content": "say something"}]

        def step(self, reply):
            raise RuntimeError("scorer down")

    results, _ = sample_episodes(
        *qwen, SamplerSpec("recall"), [Broken()], [3], SamplingParams(max_new_tokens=4)
    )
    assert results[0].reward == 0.0 and "scorer down" in results[0].error

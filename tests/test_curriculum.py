"""``[[rollout.curriculum]]``: easier tasks for the first training steps, the target task after them
and in every evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvstreams.train.config import Config
from kvstreams.train.rollouts import evaluation_plan, training_plan

STAGES = [
    {"steps": 2, "env_args": {"n_turns": 2}, "strategy_args": {"token_budget": 100}},
    {"steps": 3, "env_args": {"n_turns": 3}},
]


def _config(stages=STAGES, steps: int = 8, **rollout) -> Config:
    return Config.model_validate(
        {
            "rollout": {
                "env": "memory",
                "env_args": {"n_turns": 4, "noise_words": 8},
                "strategy_args": {"token_budget": 200, "keep_tokens": 40},
                "curriculum": stages,
                **rollout,
            },
            "train": {"steps": steps},
        }
    )


def test_each_step_samples_its_stages_task_merged_over_the_target():
    r = _config().rollout
    seen = [(r.stage_of(i), r.at_step(i).env_args, r.at_step(i).strategy_args) for i in range(7)]
    first = (0, {"n_turns": 2, "noise_words": 8}, {"token_budget": 100, "keep_tokens": 40})
    second = (1, {"n_turns": 3, "noise_words": 8}, {"token_budget": 200, "keep_tokens": 40})
    target = (2, {"n_turns": 4, "noise_words": 8}, {"token_budget": 200, "keep_tokens": 40})
    assert seen == [first] * 2 + [second] * 3 + [target] * 2
    assert r.at_step(None) is r  # evaluation: the target task from the first step on
    assert r.at_step(1).curriculum == [] and r.curriculum == _config().rollout.curriculum  # r unchanged
    # the plans say which: a training batch carries its step, an evaluation none
    cfg = _config()
    assert training_plan(cfg, 3).step == 3
    assert evaluation_plan(cfg, 2, greedy=False).step is None


@pytest.mark.parametrize(
    "stages, steps, message",
    [
        (STAGES, 5, r"stages last 5 steps of the run's 5: none would be left"),
        ([{"steps": 1, "env_args": {"n_turns": 0}}], 4, r"curriculum\[0\].*n_turns"),
        ([{"steps": 1, "env_args": {"n_turnz": 2}}], 4, r"curriculum\[0\].*n_turnz"),
        ([{"steps": 0}], 4, r"steps"),
    ],
)
def test_a_stage_that_cannot_run_is_refused_before_any_model_loads(stages, steps, message):
    with pytest.raises(ValidationError, match=message):
        _config(stages, steps)


def test_a_stage_cannot_set_strategy_args_without_a_strategy():
    with pytest.raises(ValidationError, match="strategy is none"):
        _config([{"steps": 1, "strategy_args": {"token_budget": 90}}], 4, strategy=None, mode="full")


def test_training_runs_the_stages_then_the_target_and_evaluates_the_target(model_dirs, tmp_path):
    from kvstreams.loop import train
    from test_train import small_config

    cfg = small_config(
        model_dirs["qwen3"],
        tmp_path,
        **{
            "train.steps": "3",
            "train.eval_every": "1",
            "rollout.curriculum": "[{steps = 2, env_args = {n_turns = 2}}]",
        },
    )
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (Path(cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "curriculum/stage" in r]
    assert [r["curriculum/stage"] for r in rows] == [0.0, 0.0, 1.0]
    # two turns (the fact, then the question) against the target's four: shorter episodes
    stage_tokens = [r["tokens/trace"] for r in rows[:2]]
    assert max(stage_tokens) < 0.8 * rows[2]["tokens/trace"]
    # every evaluation is on the target task: its episodes are as long as the target's training ones
    evals = [r["eval/tokens_forwarded_per_episode"] for r in rows]
    target_per_episode = rows[2]["tokens/forwarded"] / cfg.rollout.group_size
    assert min(evals) > max(stage_tokens) / cfg.rollout.group_size
    assert min(evals) > 0.5 * target_per_episode

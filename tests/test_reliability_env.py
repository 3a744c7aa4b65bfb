"""Reliability, second pass: what an environment returns is checked inside the per-episode guard, and
an evaluation says how many of its episodes failed instead of scoring them 0 without a word."""

from __future__ import annotations

import json
import math

import pytest

from kvstreams.envs.memory import MemoryEnv
from kvstreams.envs.recall import RecallEnv
from kvstreams.errors import KVStreamsError
from kvstreams.loop import train
from test_train import small_config

BAD_STEPS = {
    "reward above the range": lambda r: r._replace(reward=3.0),
    "negative reward": lambda r: r._replace(reward=-0.5),
    "NaN reward": lambda r: r._replace(reward=math.nan),
    "inf reward": lambda r: r._replace(reward=math.inf),
    "reward a string": lambda r: r._replace(reward="1"),
    "reward None": lambda r: r._replace(reward=None),
    "observation not a list": lambda r: r._replace(messages="you see a door", done=False),
    "message without content": lambda r: r._replace(messages=[{"role": "user"}], done=False),
    "info not a dict": lambda r: r._replace(info=["x"]),
}


def _flaky(monkeypatch, env_class, edit, every: int = 4):
    """Every ``every``-th environment (by reset) returns ``edit(result)`` from its steps."""
    real_step, real_reset = env_class.step, env_class.reset
    count = {"n": 0}

    def reset(self, seed):
        count["n"] += 1
        self._bad = count["n"] % every == 0
        return real_reset(self, seed)

    def step(self, reply):
        result = real_step(self, reply)
        return edit(result) if self._bad else result

    monkeypatch.setattr(env_class, "reset", reset)
    monkeypatch.setattr(env_class, "step", step)


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_a_bad_environment_answer_drops_and_counts_its_episode(
    case, model_dirs, tmp_path, monkeypatch, capsys
):
    _flaky(monkeypatch, MemoryEnv, BAD_STEPS[case])
    cfg = small_config(model_dirs["qwen3"], tmp_path, **{"train.eval_every": "0", "train.steps": "1"})
    train(cfg, show_progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rollout/failed_frac"] == 0.25  # one episode in four, dropped and counted
    assert math.isfinite(rows[-1]["reward/mean"]) and 0.0 <= rows[-1]["reward/mean"] <= 1.0
    err = capsys.readouterr().err
    assert "episode dropped, environment failed (seed " in err


def test_a_bad_single_turn_reward_is_dropped_and_counted(model_dirs, tmp_path, monkeypatch, capsys):
    _flaky(monkeypatch, RecallEnv, BAD_STEPS["NaN reward"])
    cfg = small_config(
        model_dirs["qwen3"],
        tmp_path,
        **{
            "rollout.env": '"recall"',
            "rollout.env_args": "{n_filler = 1}",
            "rollout.strategy_args": "{}",
            "rollout.max_new_tokens": "8",
            "train.eval_every": "0",
            "train.steps": "1",
        },
    )
    train(cfg, show_progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rollout/failed_frac"] == 0.25 and math.isfinite(rows[-1]["reward/mean"])
    assert "not a finite number" in capsys.readouterr().err


def test_an_environment_failing_only_in_evaluation_is_counted_and_left_out(
    model_dirs, tmp_path, monkeypatch, capsys
):
    real = MemoryEnv.held_out

    def held_out(self):
        env = real(self)
        env._held_out_fails = True
        return env

    real_step = MemoryEnv.step

    def step(self, reply):
        if getattr(self, "_held_out_fails", False) and self._seed_for_test % 2:
            raise RuntimeError("evaluation-only fault")
        return real_step(self, reply)

    real_reset = MemoryEnv.reset

    def reset(self, seed):
        self._seed_for_test = seed
        return real_reset(self, seed)

    monkeypatch.setattr(MemoryEnv, "held_out", held_out)
    monkeypatch.setattr(MemoryEnv, "step", step)
    monkeypatch.setattr(MemoryEnv, "reset", reset)
    cfg = small_config(model_dirs["qwen3"], tmp_path, **{"train.eval_episodes": "4", "train.steps": "1"})
    cfg.train.eval_every = 1
    summary = train(cfg, show_progress=False)
    evaluation = summary["eval_after"]
    assert evaluation["eval/failed_episodes"] > 0  # counted ...
    assert evaluation["eval/tasks"] < 4  # ... and left out of the figures, not scored 0
    err = capsys.readouterr().err
    assert "evaluation: " in err and "left out" in err and "evaluation-only fault" in err
    monkeypatch.setattr(MemoryEnv, "step", lambda self, reply: (_ for _ in ()).throw(RuntimeError("all")))
    with pytest.raises(KVStreamsError, match="every evaluation task"):
        train(
            small_config(model_dirs["qwen3"], tmp_path / "b", **{"train.eval_episodes": "2"}),
            show_progress=False,
        )

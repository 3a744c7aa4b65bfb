"""The ``--quick`` of the experiments that no other test runs, each with what its setting must show.

(The older experiments' quick runs are in test_experiments.py; this file is apart so that two test
workers split the load.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstreams.cli import main
from kvstreams.experiments import load_spec


def _quick(name: str, out: Path) -> dict[str, dict]:
    assert main(["experiment", name, "--quick", "--out", str(out)]) == 0
    return {r["arm"]: r for r in json.loads((out / "results.json").read_text())["runs"]}


def test_smd_fixed_quick_never_holds_more_than_its_fixed_budget(tmp_path):
    spec = load_spec("smd-fixed")
    runs = _quick("smd-fixed", tmp_path / "q")
    assert set(runs) == {"shadow", "sparse-rl"}
    for arm in spec.arms:
        if arm.name not in runs:
            continue
        budget = spec.arm_config(arm, 0, "m", tmp_path, quick=True).rollout.policy_args["budget"]
        final = runs[arm.name]["final"]
        assert final["kv/peak_entries"] <= budget  # a fixed cache size, not a share of the sequence
        assert final["kv/saving"] > 0  # and it did compress
        assert "eval/reward_mean" in runs[arm.name]["evals"]["dense"]  # served without compression too
    # the released Sparse-RL correction rejects tokens; the shadow learner has nothing to reject
    assert runs["shadow"]["means"]["mismatch/ess"] == pytest.approx(1.0, abs=1e-9)
    assert runs["sparse-rl"]["means"]["correction/kept_token_frac"] < 1.0


def test_distill_remedies_quick_logs_each_terms_gradient_and_the_advantaged_scale(tmp_path):
    runs = _quick("distill-remedies", tmp_path / "q")
    # the quick batch's groups all tie: no policy gradient, so the constant lambda's distillation is
    # the whole update, and the advantaged lambda scales it to nothing
    distill, advantaged = runs["distill"]["means"], runs["distill-advantaged"]["means"]
    assert distill["rollout/zero_variance_group_frac"] == 1.0
    assert distill["grad/pg_norm"] == 0.0 and distill["grad/distill_norm"] > 0
    assert advantaged["loss/distill_scale"] == 0.0 and "grad/distill_norm" not in advantaged
    assert advantaged["grad/norm"] == 0.0


def test_speed_to_reward_long_is_3b_but_for_its_length(tmp_path):
    short, long = load_spec("speed-to-reward"), load_spec("speed-to-reward-long")
    assert short.target_reward == long.target_reward and short.warm_start == long.warm_start
    for arm in long.arms:
        (twin,) = [a for a in short.arms if a.name == arm.name]
        a = short.arm_config(twin, 3, "m", tmp_path, quick=False).model_dump()
        b = long.arm_config(arm, 3, "m", tmp_path, quick=False).model_dump()
        assert (a["train"].pop("steps"), b["train"].pop("steps")) == (40, 120)
        assert a == b, arm.name
        # so their --quick runs are the same runs: the one below stands for both
        quick = [spec.arm_config(x, 3, "m", tmp_path, quick=True) for spec, x in ((short, twin), (long, arm))]
        assert quick[0] == quick[1], arm.name
    assert short.quick.arms == [a.name for a in long.arms] and short.quick.set == long.quick.set
    runs = _quick("speed-to-reward-long", tmp_path / "q")
    stream, reprefill = runs["stream-markovian"], runs["reprefill-markovian"]
    assert reprefill["tokens_forwarded"] > 1.2 * stream["tokens_forwarded"]  # re-prefill's cost
    assert stream["final"]["kv/peak_entries"] < runs["full"]["final"]["kv/peak_entries"]
    assert all("fact_survival" in r["evals"]["stream markovian"] for r in runs.values())


def test_recurrence_discoverable_quick_reports_carrying_under_compaction(tmp_path):
    runs = _quick("recurrence-discoverable", tmp_path / "q")
    assert set(runs) == {"no-compaction", "markovian"}
    assert all("eval/env/carried" in r["evals"]["under compaction"] for r in runs.values())
    full = runs["no-compaction"]
    assert full["final"]["kv/saving"] == 0.0 and runs["markovian"]["final"]["kv/saving"] > 0
    # the full-context policy, evaluated under compaction, holds fewer entries than in its own mode
    own, compacted = full["final"], full["evals"]["under compaction"]
    assert compacted["eval/kv/visible_max_mean"] < own["eval/kv/visible_max_mean"]


def test_distill_collapse_quick_runs_both_lambdas(tmp_path):
    spec = load_spec("distill-collapse")
    runs = _quick("distill-collapse", tmp_path / "q")
    coefs = {a.name: spec.arm_config(a, 0, "m", tmp_path, quick=True).loss.distill_coef for a in spec.arms}
    assert sorted(coefs[name] for name in runs) == [0.0, 0.1]
    for name, run in runs.items():
        assert ("loss/distill" in run["means"]) == (coefs[name] > 0)


def test_recurrence_curriculum_quick_runs_its_stages_then_the_target(tmp_path):
    runs = _quick("recurrence-curriculum", tmp_path / "q")
    for run in runs.values():
        stages = [s["curriculum/stage"] for s in run["steps"] if "curriculum/stage" in s]
        assert stages == [0.0, 1.0, 2.0]
        assert "eval/env/carried" in run["evals"]["under compaction"]


def test_speed_preset_quick_compacts_on_turns_and_evaluates_reprefill_in_both_modes(tmp_path):
    spec = load_spec("speed-preset")
    cfg = spec.arm_config(spec.arms[0], 0, "m", tmp_path, quick=False)
    assert cfg.rollout.strategy_preset == "kvstreams" and cfg.rollout.env_args["n_turns"] > 10
    runs = _quick("speed-preset", tmp_path / "q")
    stream, markovian, sliding = (
        runs[a] for a in ("stream-markovian", "reprefill-markovian", "reprefill-sliding")
    )
    # the turn trigger fired (no token budget is near): re-prefill paid for it, sliding window most
    assert stream["tokens_forwarded"] < markovian["tokens_forwarded"] < sliding["tokens_forwarded"]
    # each re-prefill run evaluated in its own mode, then served in stream mode: fewer tokens there
    own, served = markovian["final"], markovian["evals"]["stream"]
    assert own["eval/tokens_forwarded_per_episode"] > served["eval/tokens_forwarded_per_episode"]


def test_smd_70_quick_keeps_about_30_percent_and_evaluates_dense(tmp_path):
    runs = _quick("smd-70", tmp_path / "q")
    assert set(runs) == {"shadow", "sparse-rl"}
    for run in runs.values():
        # 70% of each sequence's entries dropped at each round; the cache grows again between rounds
        # (every 32 tokens), so the saving over the reply is lower (20% dropped saves about 0.18)
        assert run["final"]["kv/saving"] > 0.4
        assert "eval/reward_mean" in run["evals"]["dense"]
    assert runs["shadow"]["means"]["mismatch/ess"] == pytest.approx(1.0, abs=1e-9)
    assert runs["sparse-rl"]["means"]["mismatch/ess"] < 1.0  # the dense learner is off the sampler

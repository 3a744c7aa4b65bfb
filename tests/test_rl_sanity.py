"""Does it train? The RL sanity ladder's first rung as a test, and the evaluation that can see a gain.

Rung 1 (``configs/experiments/rl-sanity-bandit.toml``): from a fresh tiny model, the reward of one
choice (a 'z' in the reply) must rise from about 0.05 to >= 0.9 in 6 GRPO steps. The slow tests make
each classic learner bug once (advantage sign flipped, advantages zeroed, gradient cut from the
log-probs, optimizer not stepping) and check that the rung then fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstreams.envs import make_env
from kvstreams.experiments import load_spec
from kvstreams.experiments.report import check_runs
from kvstreams.loop import train
from kvstreams.tiny import make_tiny_model
from kvstreams.train import loss as losses
from kvstreams.train import prepare
from kvstreams.train.evaluation import pass_at_k, summarise


def _bandit(tmp_path, arm: str = "shadow") -> tuple[float, float]:
    """Rung 1's run at seed 0: held-out reward before and after."""
    spec = load_spec("rl-sanity-bandit")
    model = make_tiny_model(tmp_path / "fresh", seed=0)
    (chosen,) = [a for a in spec.arms if a.name == arm]
    cfg = spec.arm_config(chosen, 0, str(model), tmp_path / "run", quick=False)
    summary = train(cfg, show_progress=False)
    return summary["eval_before"]["eval/reward_mean"], summary["eval_after"]["eval/reward_mean"]


def test_rung1_bandit_learns_from_scratch(tmp_path):
    torch.set_num_threads(2)
    before, after = _bandit(tmp_path)
    assert before < 0.3, f"the fresh model already earns {before}: the rung would test nothing"
    assert after >= 0.9, f"GRPO did not learn the bandit: {before:.3f} -> {after:.3f}"


def _flip(monkeypatch):
    real = prepare.group_advantages
    monkeypatch.setattr(prepare, "group_advantages", lambda *a, **k: -real(*a, **k))


def _zero(monkeypatch):
    real = prepare.group_advantages
    monkeypatch.setattr(prepare, "group_advantages", lambda *a, **k: torch.zeros_like(real(*a, **k)))


def _detach(monkeypatch):
    real = losses.ppo_clip_loss
    monkeypatch.setattr(losses, "ppo_clip_loss", lambda logp, *a: real(logp.detach(), *a))


def _no_step(monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)


MUTATIONS = {"advantage_sign": _flip, "advantages_zero": _zero, "detached": _detach, "no_step": _no_step}


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_rung1_fails_under_each_learner_bug(tmp_path, monkeypatch, mutation):
    torch.set_num_threads(2)
    MUTATIONS[mutation](monkeypatch)
    try:
        before, after = _bandit(tmp_path)
    except RuntimeError as err:  # a loss with no gradient cannot even step: the rung fails loudly
        assert mutation == "detached", err
        return
    assert after < 0.9, f"rung 1 passed with the {mutation} bug: {before:.3f} -> {after:.3f}"


def test_pass_at_k_is_the_unbiased_estimator():
    # Chen et al. (2021): 1 - C(n - c, k) / C(n, k)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - (7 * 6) / (10 * 9))
    # averaged over random draws of k of the n samples, the share of draws holding a success
    import itertools

    outcomes = [1, 0, 0, 1, 0]
    draws = list(itertools.combinations(outcomes, 3))
    assert pass_at_k(5, 2, 3) == pytest.approx(sum(any(d) for d in draws) / len(draws))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_evaluation_summary_counts_full_credit_as_solved_and_gives_intervals():
    sampled = [[1.0, 0.5, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 1.0]]
    m = summarise(sampled, greedy=[1.0, 0.5, 0.0])
    assert m["eval/reward_mean"] == pytest.approx((2.5 + 2.0 + 1.0) / 12)
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0 + 1 / 4) / 3)  # 0.5 is not solved
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/reward_greedy"] == pytest.approx(0.5)
    # the interval is over tasks (t with 2 degrees of freedom), not over the 12 episodes
    per_task = torch.tensor([0.5, 0.0, 0.25])
    assert m["eval/pass@1_ci"] == pytest.approx(4.303 * float(per_task.std()) / 3**0.5, rel=1e-3)


def test_zero_variance_groups_are_counted_and_can_be_dropped():
    from kvstreams.train.prepare import zero_variance_groups

    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 1.0, 0.0, 0.0])
    valid = torch.tensor([True, True, True, True, True, True, True, False, False])
    # group 0 varies; group 1 is flat; group 2 has one valid episode (no comparison possible)
    assert zero_variance_groups(rewards, 3, valid).tolist() == [False, True, True]


def test_check_fails_a_run_below_its_bar():
    spec = load_spec("rl-sanity-bandit")
    results = [
        {
            "arm": "shadow",
            "seed": 0,
            "start": {"eval/reward_mean": 0.05},
            "final": {"eval/reward_mean": 0.95},
        },
        {"arm": "naive", "seed": 0, "start": {"eval/reward_mean": 0.05}, "final": {"eval/reward_mean": 0.40}},
    ]
    checks = check_runs(spec, results, quick=False)
    assert checks["failed"] == 1
    assert [r["passed"] for r in checks["runs"]] == [False, True]  # sorted: naive, shadow


def test_bandit_pays_the_target_only():
    env = make_env("bandit", target="z")
    env.reset(0)
    assert env.step("a buzz").reward == 1.0
    assert env.step("a bee").reward == 0.0


def test_sft_stops_once_validation_reward_reaches_the_target(tmp_path, monkeypatch):
    """A warm start weak on purpose: SFT stops at the first check where the held-out validation reward
    reaches ``sft.stop_at_reward``; the validation tasks are not the evaluation's."""
    from kvstreams.train import evaluation, sft
    from kvstreams.train.config import validate_config

    base = make_tiny_model(tmp_path / "base", seed=0)
    cfg = validate_config(
        {
            "rollout": {"env": "bandit", "max_new_tokens": 4},
            "sft": {
                "base": str(base),
                "out": str(tmp_path / "sft"),
                "episodes": 8,
                "steps": 300,
                "lr": 3e-3,
                "stop_at_reward": 0.9,
                "check_every": 5,
                "check_episodes": 16,
            },
        }
    )
    seeds: list[int] = []
    real = evaluation.evaluation_plan

    def spy(cfg, n, greedy, samples=1):
        plan = real(cfg, n, greedy, samples)
        seeds.extend(plan.env_seeds)
        return plan

    monkeypatch.setattr(evaluation, "evaluation_plan", spy)
    summary = sft.sft(cfg, show_progress=False)
    stop = summary["stopped_at_reward"]
    assert stop is not None and stop["validation_reward"] >= 0.9
    assert summary["steps"] == stop["step"] < 300 and stop["step"] % 5 == 0
    assert min(seeds) == cfg.train.eval_seed + 500_000  # never the evaluation's tasks


def test_experiment_exits_nonzero_when_a_run_fails_its_check(tmp_path):
    """A one-arm bandit trained for one step cannot reach 0.9: the command says so and exits 1; a
    ladder over it fails the same way."""
    from kvstreams.cli import main

    spec = (Path(__file__).resolve().parents[1] / "configs/experiments/rl-sanity-bandit.toml").read_text()
    spec = spec.replace('name = "rl-sanity-bandit"', 'name = "one-step-bandit"')
    head, _, _ = spec.partition("[[arms]]")
    rung = tmp_path / "one-step-bandit.toml"
    rung.write_text(
        head + '[[arms]]\nname = "shadow"\n\n[check]\nmetric = "eval/reward_mean"\nfinal_at_least = 0.9\n'
    )
    args = ["experiment", str(rung), "--quick", "--set", "train.steps=1", "--set", "train.eval_every=1"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 1
    checks = json.loads((tmp_path / "run" / "results.json").read_text())["checks"]
    assert checks["failed"] == 1 and checks["runs"][0]["after"] < 0.9
    ladder = tmp_path / "ladder.toml"
    ladder.write_text(
        f'name = "ladder"\ntitle = "t"\nsource = "s"\nquestion = "q"\nkind = "ladder"\nrungs = ["{rung}"]\n'
    )
    out = tmp_path / "ladder-run"
    assert main(["experiment", str(ladder), "--quick", "--set", "train.steps=1", "--out", str(out)]) == 1
    assert (out / "one-step-bandit" / "results.json").is_file()
    assert "1 runs fail their check" in (out / "results.md").read_text()

"""The learner: loss terms against hand-computed values, the shadow ratio, baselines, the loop,
checkpoints and resume, configs, SFT."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvstreams.errors import KVStreamsError
from kvstreams.train import loss as L
from kvstreams.train.config import load_config
from kvstreams.train.learner import Learner
from kvstreams.train.rollouts import RolloutSource

# --- loss terms --------------------------------------------------------------------------------------


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    assert torch.allclose(
        L.group_advantages(rewards, 2), torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]), atol=1e-5
    )
    assert torch.allclose(
        L.group_advantages(rewards, 2, normalize_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0])
    )
    with pytest.raises(ValueError):
        L.group_advantages(rewards, 4)


def test_ppo_clip_loss_with_clip_higher():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, ratio, clipped = L.ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(ratio, torch.tensor([1.5, 0.5, 1.1]))
    assert torch.allclose(loss, torch.tensor([-1.28, 0.8, -1.1]))
    assert clipped.tolist() == [True, True, False]


def test_kl_entropy_distillation_weights():
    assert float(L.kl_k3(torch.log(torch.tensor(0.5)), torch.log(torch.tensor(0.25)))) == pytest.approx(
        0.5 - 1 + math.log(2)
    )
    assert float(L.entropy_from_logits(torch.zeros(4))) == pytest.approx(math.log(4))
    teacher = torch.log(torch.tensor([[0.5, 0.5]]))
    student_logits = torch.log(torch.tensor([[0.25, 0.75]]))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(L.distillation_kl(teacher, student_logits)) == pytest.approx(expected, rel=1e-5)
    w = L.truncated_importance_weights(torch.tensor([0.5, -1.0, 0.1]), torch.zeros(3), 0.8, 1.2)
    assert torch.allclose(w, torch.tensor([1.2, 0.8, math.exp(0.1)]))
    keep = L.reject_most_deviated(torch.tensor([0.1, 0.9, 0.5, 0.2, 0.3]), 0.2)
    assert keep.tolist() == [True, False, True, True, True]


def test_aggregation():
    per_token = torch.tensor([1.0, 3.0, 10.0])
    seq = torch.tensor([0, 0, 1])
    assert float(L.aggregate(per_token, seq, 2, "token", total_tokens=3)) == pytest.approx(14 / 3)
    assert float(L.aggregate(per_token, seq, 2, "sequence", total_tokens=3)) == pytest.approx((2 + 10) / 2)


def test_distillation_gradient_does_not_reach_the_teacher():
    teacher_params = torch.randn(3, 5, requires_grad=True)
    student = torch.randn(3, 5, requires_grad=True)
    teacher_logp = torch.log_softmax(teacher_params, dim=-1)  # would carry grad if not detached
    L.distillation_kl(teacher_logp, student).sum().backward()
    assert teacher_params.grad is None
    assert student.grad is not None and float(student.grad.abs().sum()) > 0


# --- the learner on real rollouts -----------------------------------------------------------------


def small_config(model_dir: str, tmp_path, **sets):
    overrides = [
        f'model.path="{model_dir}"',
        "rollout.env_args={n_turns = 4, n_facts = 1, noise_words = 12}",
        "rollout.prompts_per_step=1",
        "rollout.group_size=4",
        "rollout.max_reply_tokens=16",
        "rollout.strategy_args={budget = 160}",
        "train.steps=2",
        "train.eval_every=2",
        "train.eval_episodes=2",
        f'train.out_dir="{tmp_path / "run"}"',
        "optim.lr=1e-3",
    ] + [f"{k}={v}" for k, v in sets.items()]
    return load_config(None, overrides)


def learner_step_then_restore(model, cfg, batch) -> dict[str, float]:
    """One learner step on the shared session model, which is put back as it was afterwards."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        return Learner(model, cfg).step(batch)
    finally:
        model.load_state_dict(state)


@pytest.mark.parametrize(("correction", "shadow_ratio"), [("shadow", True), ("naive", False)])
def test_first_update_ratio_is_one_only_under_shadow(qwen, model_dirs, tmp_path, correction, shadow_ratio):
    model, tok = qwen
    cfg = small_config(model_dirs["qwen3"], tmp_path, **{"loss.correction": f'"{correction}"'})
    batch = RolloutSource(model, tok, cfg).collect(step=0)
    assert batch.stats.compactions > 0  # the rollouts really were compacted
    metrics = learner_step_then_restore(model, cfg, batch)
    if shadow_ratio:
        assert metrics["ratio/first_update_max_abs_dev"] < 1e-4
        assert metrics["mismatch/kl"] < 1e-9
        assert metrics["loss/distill"] > 0
    else:
        assert metrics["ratio/first_update_max_abs_dev"] > 1e-2
        assert metrics["mismatch/kl"] > 1e-3
        assert metrics["loss/distill"] == 0


@pytest.mark.parametrize("correction", ["tis", "sparse_rl"])
def test_importance_weighted_baselines(qwen, model_dirs, tmp_path, correction):
    model, tok = qwen
    cfg = small_config(
        model_dirs["qwen3"], tmp_path, **{"loss.correction": f'"{correction}"', "rollout.group_size": 5}
    )
    batch = RolloutSource(model, tok, cfg).collect(step=0)
    metrics = learner_step_then_restore(model, cfg, batch)
    # pi_old is the learner's own dense log-prob: ratio 1 at the first update, weights do the correcting
    assert metrics["ratio/first_update_max_abs_dev"] < 1e-4
    assert metrics["rollout/discarded_frac"] == pytest.approx(0.2 if correction == "sparse_rl" else 0.0)


def test_train_end_to_end_and_resume_matches(model_dirs, tmp_path):
    from kvstreams.train.loop import train

    cfg = small_config(model_dirs["qwen3"], tmp_path / "a")
    summary = train(cfg, show_progress=False)
    run = tmp_path / "a" / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "reward/mean",
        "mismatch/kl",
        "loss/pg",
        "loss/distill",
        "clip/frac",
        "entropy/mean",
        "response/length_mean",
        "kv/peak_bytes",
        "tokens/forwarded",
        "tokens/reprefilled",
        "rollout/discarded_frac",
    ):
        assert key in rows[1], key
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2]
    assert {p.name for p in run.glob("*.png")} >= {"reward.png", "mismatch.png", "kv.png", "tokens.png"}
    assert any((run / "tensorboard").iterdir())
    assert summary["mismatch_kl_mean"] < 1e-9
    assert len(list((run / "checkpoints").glob("step-*"))) == 2

    # interrupted after step 1, resumed: step 2 is the same as in the uninterrupted run
    cfg_b = small_config(model_dirs["qwen3"], tmp_path / "b", **{"train.steps": 1})
    train(cfg_b, show_progress=False)
    with pytest.raises(KVStreamsError, match="--resume"):
        train(cfg_b, show_progress=False)
    cfg_b2 = small_config(model_dirs["qwen3"], tmp_path / "b")
    train(cfg_b2, resume=True, show_progress=False)
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == [0, 1, 2]
    for key in ("loss/pg", "loss/distill", "entropy/mean", "reward/mean", "tokens/forwarded"):
        assert rows_b[2][key] == pytest.approx(rows[2][key], rel=1e-5, abs=1e-7), key


def test_async_training_records_versions(model_dirs, tmp_path):
    from kvstreams.train.loop import train

    cfg = small_config(
        model_dirs["qwen3"],
        tmp_path,
        **{
            "train.asynchronous": "true",
            "train.steps": 3,
            "train.eval_every": 0,
            "train.max_off_policy_steps": 2,
        },
    )
    train(cfg, show_progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/staleness_max"] <= 2  # never more than max_off_policy_steps behind
    # new weights reached the rollout engine (possibly mid-episode, without flushing its cache)
    assert max(r["rollout/version_max"] for r in rows) >= 1


def test_reprefill_baseline_trains_segments(qwen, model_dirs, tmp_path):
    model, tok = qwen
    cfg = small_config(
        model_dirs["qwen3"], tmp_path, **{"rollout.mode": '"reprefill"', "loss.correction": '"reprefill"'}
    )
    batch = RolloutSource(model, tok, cfg).collect(step=0)
    assert len(batch.samples) > len(batch.rewards)  # several segments per episode
    metrics = learner_step_then_restore(model, cfg, batch)
    assert metrics["ratio/first_update_max_abs_dev"] < 1e-4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stepz=3"], "train.stepz: Extra inputs"),
        (["train.steps=abc"], "train.steps"),
        (['loss.correction="reprefill"'], "rollout.mode = 'reprefill'"),
        (['rollout.mode="reprefill"'], "loss.correction = 'reprefill'"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (['loss.correction="magic"'], "loss.correction"),
        (['rollout.strategy="markovian"', 'rollout.policy="snapkv"'], "cannot be combined"),
    ],
)
def test_bad_configs(overrides, message):
    with pytest.raises(KVStreamsError, match="bad config") as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(KVStreamsError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(KVStreamsError, match="invalid TOML"):
        load_config(bad)


def test_sft_learns_the_expert(model_dirs, tmp_path, qwen):
    from kvstreams.models import load_model
    from kvstreams.train.sft import demonstrations, sft

    _, tok = qwen
    ((tokens, mask),) = demonstrations(tok, "memory", {"n_turns": 2}, 1, seed=0)
    text = tok.decode([t for t, m in zip(tokens, mask, strict=True) if m])
    assert "<state>" in text and "Turn" not in text  # loss on the expert's replies only
    cfg = load_config(
        None,
        [
            f'sft.base="{model_dirs["qwen3"]}"',
            f'sft.out="{tmp_path / "sft"}"',
            "sft.steps=20",
            "sft.episodes=8",
            "rollout.env_args={n_turns = 3}",
        ],
    )
    summary = sft(cfg, show_progress=False)
    assert summary["loss_last"] < summary["loss_first"] / 3
    load_model(tmp_path / "sft")


def test_grpo_updates_favour_rewarded_episodes(qwen, model_dirs, tmp_path):
    """Rewards are set by hand on real rollouts: after a few updates the log-prob of the rewarded
    episodes rises and that of the others falls."""
    from kvstreams.replay import replay_logprobs
    from kvstreams.train.learner import trained_positions

    model, tok = qwen
    cfg = small_config(
        model_dirs["qwen3"], tmp_path, **{"loss.distill_coef": 0, "optim.updates_per_batch": 3}
    )
    batch = RolloutSource(model, tok, cfg).collect(step=0)
    batch.rewards = [1.0, 0.0, 1.0, 0.0]

    def sequence_logp() -> list[float]:
        lps = replay_logprobs(model, [s.trace for s in batch.samples])
        return [float(lp[trained_positions(s)].sum()) for lp, s in zip(lps, batch.samples, strict=True)]

    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        before = sequence_logp()
        Learner(model, cfg).step(batch)
        after = sequence_logp()
    finally:
        model.load_state_dict(state)
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    rewarded = [d for d, s in zip(deltas, batch.samples, strict=True) if batch.rewards[s.episode] > 0]
    others = [d for d, s in zip(deltas, batch.samples, strict=True) if batch.rewards[s.episode] == 0]
    assert min(rewarded) > 0 > max(others)

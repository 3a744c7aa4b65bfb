"""The learner: loss terms against hand-computed values, the shadow ratio, baselines, the loop,
checkpoints and resume, configs, SFT."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from kvstreams.errors import KVStreamsError
from kvstreams.train import loss as L
from kvstreams.train.config import load_config, to_toml
from kvstreams.train.corrections import Behaviour, NaiveLoss, SparseRLLoss, SparseRLReleasedLoss, TISLoss
from kvstreams.train.learner import Learner
from kvstreams.train.prepare import learner_items
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


def test_aggregation_counts_kept_tokens_only():
    per_token = torch.tensor([1.0, 3.0, 10.0, 100.0])
    seq = torch.tensor([0, 0, 1, 2])
    everything = torch.ones(4, dtype=torch.bool)
    assert float(L.aggregate(per_token[:3], seq[:3], everything[:3], "token", 3, 2)) == pytest.approx(14 / 3)
    assert float(L.aggregate(per_token[:3], seq[:3], everything[:3], "sequence", 3, 2)) == pytest.approx(6)
    # token 1 rejected, sequence 2 rejected whole: they leave the sums and the normalisers
    keep = torch.tensor([True, False, True, False])
    assert float(L.aggregate(per_token, seq, keep, "token", 2, 2)) == pytest.approx(11 / 2)
    assert float(L.aggregate(per_token, seq, keep, "sequence", 2, 2)) == pytest.approx((1 + 10) / 2)


def test_objective_assembles_every_term_by_hand():
    """Two kept tokens of sequence 0 and one rejected token: PPO (clip-higher) x weight - entropy bonus
    + k3 KL + distillation, each a mean over the 2 kept tokens; the rejected token counts nowhere."""
    logp = torch.log(torch.tensor([0.6, 0.3, 0.9])).requires_grad_()
    logits = torch.zeros(3, 2)  # uniform policy over 2 tokens: entropy log 2 everywhere
    teacher = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.5, 0.5]]))
    x = L.LossInputs(
        logp=logp,
        old_logp=torch.log(torch.tensor([0.4, 0.3, 0.1])),
        advantages=torch.tensor([1.0, -2.0, 5.0]),
        weight=torch.tensor([1.0, 0.5, 1.0]),
        keep=torch.tensor([True, True, False]),
        seq=torch.tensor([0, 0, 1]),
        norm=L.Normaliser(tokens=2, seqs=1, mode="token"),
        logits=logits,
        ref_logp=torch.log(torch.tensor([0.3, 0.3, 0.9])),
        teacher_logp=teacher,
    )
    c = L.Coefficients(clip_low=0.2, clip_high=0.28, entropy_coef=0.1, kl_coef=0.5, distill_coef=2.0)
    out = L.objective(x, c)
    # token 0: ratio 1.5 clipped at 1.28 (A > 0): -1.28; token 1: ratio 1, -(-2) x weight 0.5 = 1
    pg = (-1.28 + 1.0) / 2
    kl = ((0.5 - 1 - math.log(0.5)) + 0.0) / 2  # r = 0.3 / 0.6, then r = 1
    distill = (0.0 + (0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5))) / 2
    assert float(out.metrics["loss/pg"]) == pytest.approx(pg)
    assert float(out.metrics["entropy/mean"]) == pytest.approx(math.log(2))
    assert float(out.metrics["loss/kl"]) == pytest.approx(kl)
    assert float(out.metrics["loss/distill"]) == pytest.approx(distill, rel=1e-5)
    assert float(out.metrics["clip/frac"]) == pytest.approx(0.5)
    assert float(out.metrics["ratio/mean"]) == pytest.approx((1.5 + 1.0) / 2)
    expected = pg - 0.1 * math.log(2) + 0.5 * kl + 2.0 * distill
    assert float(out.total) == pytest.approx(expected, rel=1e-5)
    out.total.backward()
    assert float(logp.grad[2]) == 0.0  # the rejected token gets no gradient
    assert float(logp.grad[0]) == pytest.approx(0.5 * (1 - 0.3 / 0.6) / 2)  # clipped PG: the KL alone


# --- the corrections on hand-made log-probs --------------------------------------------------------


def behaviour(start: list[float], sampler: list[float], seq: list[int]) -> Behaviour:
    return Behaviour(torch.tensor(sampler), torch.tensor(start), torch.tensor(seq), max(seq) + 1)


def test_tis_truncates_the_learner_over_sampler_ratio():
    b = behaviour([0.5, -1.0, 0.1], [0.0, 0.0, 0.0], [0, 0, 1])
    w = TISLoss(type="tis").weigh(b)
    assert torch.allclose(w.weight, torch.tensor([math.exp(0.5), math.exp(-1.0), math.exp(0.1)]))
    w = TISLoss(type="tis", cap=1.2, floor=0.8).weigh(b)
    assert torch.allclose(w.weight, torch.tensor([1.2, 0.8, math.exp(0.1)]))
    assert torch.equal(w.old_logp, b.start_logp) and bool(w.keep.all())


def test_sparse_rl_as_smd_describes_it():
    # five sequences of two tokens; sequence 3 deviates most (mean |log rho| 1.0): the top 20% go
    start = [-1.0, -1.0, -2.0, -2.1, -0.5, -0.6, 0.0, -2.0, -3.0, -3.0]
    sampler = [-1.1, -0.9, -2.0, -2.0, -0.5, -0.5, -1.0, -1.0, -3.2, -3.0]
    seq = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    w = SparseRLLoss(type="sparse_rl").weigh(behaviour(start, sampler, seq))
    assert w.keep.tolist() == [True] * 6 + [False, False] + [True, True]
    rho = torch.exp(torch.tensor(start) - torch.tensor(sampler))
    assert torch.allclose(w.weight, rho.clamp(0.8, 1.2))


def test_sparse_rl_released_rule():
    # token band [0.5, 1.5], weights min(rho, 1.5) / mean, veto below 1e-4
    log_rho = [0.0, math.log(2.0), math.log(0.6), 0.0, math.log(1e-5), 0.0, math.log(0.4)]
    seq = [0, 0, 0, 1, 1, 2, 2]
    w = SparseRLReleasedLoss(type="sparse_rl_released").weigh(behaviour(log_rho, [0.0] * 7, seq))
    # token 1 (rho 2) and token 6 (rho 0.4) leave the band; sequence 1 is vetoed whole by token 4
    assert w.keep.tolist() == [True, False, True, False, False, True, False]
    raw = torch.tensor([1.0, 1.5, 0.6, 1.0, 1e-5, 1.0, 0.4])
    assert torch.allclose(w.weight, raw / raw.mean(), rtol=1e-4)
    assert w.metrics["correction/vetoed_seq_frac"] == pytest.approx(1 / 3)
    unnormalised = SparseRLReleasedLoss(type="sparse_rl_released", batch_normalize=False, veto_threshold=0)
    w = unnormalised.weigh(behaviour(log_rho, [0.0] * 7, seq))
    assert torch.allclose(w.weight, raw, rtol=1e-4)
    assert w.keep.tolist() == [True, False, True, True, False, True, False]  # no veto: only the band


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
        "rollout.strategy_args={token_budget = 160}",
        "train.steps=2",
        "train.eval_every=2",
        "train.eval_episodes=2",
        f'train.out_dir="{tmp_path / "run"}"',
        "optim.lr=1e-3",
    ] + [f"{k}={v}" for k, v in sets.items()]
    return load_config(None, overrides)


def items_of(batch, cfg, step: int = 0):
    return learner_items(
        batch, step, cfg.rollout.group_size, cfg.loss.normalize_std, cfg.train.max_off_policy_steps
    )[0]


def learner_step_then_restore(model, cfg, batch, loss=None) -> dict[str, float]:
    """One learner step on the shared session model, which is put back as it was afterwards."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        learner = Learner(model, cfg)
        if loss is not None:
            learner.loss = loss
        return learner.step(batch if isinstance(batch, list) else items_of(batch, cfg))
    finally:
        model.load_state_dict(state)


@pytest.fixture(scope="module")
def compacted_batch(qwen, model_dirs, tmp_path_factory):
    """Real rollouts with compaction (stream mode), shared by the learner tests."""
    model, tok = qwen
    cfg = small_config(model_dirs["qwen3"], tmp_path_factory.mktemp("batch"), **{"rollout.group_size": 5})
    batch = RolloutSource(model, tok, cfg).collect(step=0)
    assert batch.stats.compactions > 0  # the rollouts really were compacted
    return batch


@pytest.mark.parametrize(
    ("correction", "ratio_one", "mismatch"),
    [("shadow", True, False), ("naive", True, True), ("behaviour_ratio", False, True)],
)
def test_first_update_ratio_and_mismatch(
    qwen, model_dirs, tmp_path, compacted_batch, correction, ratio_one, mismatch
):
    """shadow: ratio 1 and no mismatch; naive (SMD's): ratio 1 (pi_old is the dense learner) but the
    mismatch is there, uncorrected; behaviour_ratio: pi_old is the sampler, so the ratio is off 1."""
    model, _ = qwen
    cfg = small_config(
        model_dirs["qwen3"], tmp_path, **{"loss.type": f'"{correction}"', "rollout.group_size": 5}
    )
    metrics = learner_step_then_restore(model, cfg, compacted_batch)
    assert (metrics["ratio/first_update_max_abs_dev"] < 1e-4) == ratio_one
    assert (metrics["mismatch/k3_kl"] > 1e-3) == mismatch
    assert (metrics["mismatch/abs_logprob_diff_max"] > 1e-1) == mismatch
    if not mismatch:
        assert metrics["mismatch/k3_kl"] < 1e-9 and metrics["mismatch/ess"] > 1 - 1e-6
        assert metrics["loss/distill"] > 0  # SMD's dense teacher, lambda 0.1 by default
    else:
        assert "loss/distill" not in metrics and metrics["mismatch/ess"] < 1


def test_each_terms_gradient_norm_is_measured_and_the_update_is_their_sum(
    qwen, model_dirs, tmp_path, compacted_batch
):
    """train.term_grad_norms: the policy gradient's and SMD distillation's gradient norms are logged
    apart; the update is their sum, so the total gradient norm is the one backward's (float rounding)."""
    model, _ = qwen
    sets = {"rollout.group_size": 5, "loss.distill_coef": 0.5, "optim.grad_clip": 1e9}
    plain_cfg = small_config(model_dirs["qwen3"], tmp_path, **sets)
    # advantages set by hand: the tiny model's groups may all score alike, and a zero advantage has no PG
    items = [
        dataclasses.replace(item, advantage=a)
        for item, a in zip(items_of(compacted_batch, plain_cfg), (1.0, -1.0, 0.5, -0.5, 0.25), strict=False)
    ]
    plain = learner_step_then_restore(model, plain_cfg, items)
    cfg = small_config(model_dirs["qwen3"], tmp_path, **sets, **{"train.term_grad_norms": "true"})
    by_term = learner_step_then_restore(model, cfg, items)
    assert "grad/pg_norm" not in plain
    assert by_term["grad/pg_norm"] > 0 and by_term["grad/distill_norm"] > 0
    assert by_term["grad/norm"] == pytest.approx(plain["grad/norm"], rel=1e-4)
    # the two parts' norms bound the sum's (triangle inequality), and neither is the whole
    assert by_term["grad/norm"] <= by_term["grad/pg_norm"] + by_term["grad/distill_norm"] + 1e-6
    assert abs(by_term["grad/pg_norm"] - by_term["grad/norm"]) > 1e-6
    with pytest.raises(KVStreamsError, match="one learner process"):
        small_config(
            model_dirs["qwen3"],
            tmp_path,
            **{"train.term_grad_norms": "true", "cluster.learner_world_size": 2},
        )


def test_advantaged_distillation_scales_lambda_by_the_share_of_traces_with_an_advantage(
    qwen, model_dirs, tmp_path, compacted_batch
):
    """loss.distill_scaling = "advantaged": 3 of 5 traces have a non-zero advantage, so the distillation
    term's gradient is 0.6 of the constant lambda's; the policy gradient's is unchanged."""
    model, _ = qwen
    sets = {"rollout.group_size": 5, "loss.distill_coef": 0.5, "train.term_grad_norms": "true"}
    constant_cfg = small_config(model_dirs["qwen3"], tmp_path, **sets)
    items = [
        dataclasses.replace(item, advantage=a)
        for item, a in zip(items_of(compacted_batch, constant_cfg), (1.0, -1.0, 0.0, 0.0, 0.5), strict=False)
    ]
    constant = learner_step_then_restore(model, constant_cfg, items)
    cfg = small_config(model_dirs["qwen3"], tmp_path, **sets, **{"loss.distill_scaling": '"advantaged"'})
    scaled = learner_step_then_restore(model, cfg, items)
    assert "loss/distill_scale" not in constant and scaled["loss/distill_scale"] == pytest.approx(0.6)
    assert scaled["grad/distill_norm"] == pytest.approx(0.6 * constant["grad/distill_norm"], rel=1e-4)
    assert scaled["grad/pg_norm"] == pytest.approx(constant["grad/pg_norm"], rel=1e-5)


@pytest.mark.parametrize("correction", ["tis", "sparse_rl", "sparse_rl_released"])
def test_importance_weighted_baselines(qwen, model_dirs, tmp_path, compacted_batch, correction):
    model, _ = qwen
    cfg = small_config(
        model_dirs["qwen3"], tmp_path, **{"loss.type": f'"{correction}"', "rollout.group_size": 5}
    )
    metrics = learner_step_then_restore(model, cfg, compacted_batch)
    # pi_old is the learner's own dense log-prob: ratio 1 at the first update, weights do the correcting
    assert metrics["ratio/first_update_max_abs_dev"] < 1e-4
    if correction == "sparse_rl":  # 5 sequences: the most deviated one goes
        assert metrics["correction/discarded_seq_frac"] == pytest.approx(0.2)
    if correction == "sparse_rl_released":  # the dense learner is far off: the band rejects tokens
        assert 0 < metrics["correction/band_rejected_token_frac"] < 1
        assert metrics["correction/kept_token_frac"] < 1


class DropFirstSequence(NaiveLoss):
    """Test correction: the naive baseline that rejects every token of the batch's first sequence."""

    def weigh(self, b):
        w = super().weigh(b)
        w.keep = b.seq != 0
        return w


def test_rejected_tokens_leave_the_loss_and_its_normaliser(qwen, model_dirs, tmp_path, compacted_batch):
    """Rejecting a sequence must train exactly as if it had never been in the batch: same loss,
    entropy and gradient (before clipping) as the same correction on the other sequences alone."""
    model, _ = qwen
    cfg = small_config(model_dirs["qwen3"], tmp_path, **{"loss.type": '"naive"', "rollout.group_size": 5})
    items = items_of(compacted_batch, cfg)
    rejected = learner_step_then_restore(model, cfg, items, loss=DropFirstSequence(type="naive"))
    without = learner_step_then_restore(model, cfg, items[1:])
    for key in ("loss/pg", "entropy/mean", "grad/norm", "tokens/trained"):
        assert rejected[key] == pytest.approx(without[key], rel=1e-4, abs=1e-7), key
    assert rejected["correction/discarded_seq_frac"] == pytest.approx(1 / len(items))


def test_smd_teacher_is_recomputed_in_every_update_epoch(
    qwen, model_dirs, tmp_path, compacted_batch, monkeypatch
):
    """Algorithm 1: the dense teacher comes from the current weights in every optimisation epoch, one
    micro-batch at a time, right before that micro-batch's shadow forward."""
    model, _ = qwen
    cfg = small_config(
        model_dirs["qwen3"],
        tmp_path,
        **{"rollout.group_size": 5, "optim.updates_per_batch": 2, "optim.micro_batch_tokens": 400},
    )
    calls: list[tuple[str, int]] = []
    original = Learner._rows

    def spy(self, m, mb, mode):
        calls.append((mode, mb.first_seq))
        return original(self, m, mb, mode)

    monkeypatch.setattr(Learner, "_rows", spy)
    learner_step_then_restore(model, cfg, compacted_batch)
    n_mbs = len({first for _, first in calls})
    assert n_mbs > 1  # several micro-batches
    assert calls == [
        (mode, first)
        for _ in range(2)
        for first in sorted({f for _, f in calls})
        for mode in ("dense", "shadow")
    ]


def test_train_end_to_end_and_resume_matches(model_dirs, tmp_path):
    from kvstreams.loop import train

    cfg = small_config(model_dirs["qwen3"], tmp_path / "a")
    summary = train(cfg, show_progress=False)
    run = tmp_path / "a" / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "reward/mean",
        "mismatch/kl",
        "mismatch/k3_kl",
        "mismatch/chi2_token",
        "mismatch/log_ppl_diff",
        "mismatch/is_weight_std",
        "mismatch/ess",
        "mismatch/abs_logprob_diff_max",
        "loss/pg",
        "loss/distill",
        "clip/frac",
        "entropy/mean",
        "response/length_mean",
        "kv/peak_bytes",
        "tokens/forwarded",
        "tokens/reprefilled",
        "tokens/reprefill_equivalent",
        "correction/discarded_seq_frac",
        "off_policy/token_staleness_max",
        "off_policy/dropped_frac",
    ):
        assert key in rows[1], key
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2]
    # the environment's own outcomes, per step and per evaluation: with one fact, "correct" is the reward
    for r in rows[1:]:
        assert r["env/correct"] == pytest.approx(r["reward/mean"]) and 0 <= r["env/carried"] <= 1
    assert rows[2]["eval/env/correct"] == pytest.approx(rows[2]["eval/reward_mean"])
    assert {p.name for p in run.glob("*.png")} >= {"reward.png", "mismatch.png", "kv.png", "tokens.png"}
    assert any((run / "tensorboard").iterdir())
    assert summary["mismatch_k3_kl_mean"] < 1e-9
    assert "first compaction" in summary["tokens_reprefill_equivalent_formula"]
    assert len(list((run / "checkpoints").glob("step-*"))) == 2
    # synchronous: the rollouts of step s are sampled by version s, every token fresh
    for r in rows[1:]:
        assert r["rollout/version_min"] == r["rollout/version_max"] == r["step"] - 1
        assert r["off_policy/token_staleness_max"] == 0 and r["off_policy/token_frac_0"] == 1

    # interrupted after step 1, resumed: step 2 is the same as in the uninterrupted run
    cfg_b = small_config(model_dirs["qwen3"], tmp_path / "b", **{"train.steps": 1})
    train(cfg_b, show_progress=False)
    with pytest.raises(KVStreamsError, match="--resume"):
        train(cfg_b, show_progress=False)
    cfg_b2 = small_config(model_dirs["qwen3"], tmp_path / "b")
    train(cfg_b2, resume=True, show_progress=False)
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == [0, 1, 2]
    for key in (
        "loss/pg",
        "loss/distill",
        "entropy/mean",
        "reward/mean",
        "tokens/forwarded",
        "rollout/version_min",
    ):
        assert rows_b[2][key] == pytest.approx(rows[2][key], rel=1e-5, abs=1e-7), key


def test_async_training_versions_within_the_bounds(model_dirs, tmp_path):
    from kvstreams.loop import train

    cfg = small_config(
        model_dirs["qwen3"],
        tmp_path,
        **{
            "train.asynchronous": "true",
            "train.steps": 4,
            "train.eval_every": 0,
            "train.max_async_level": 1,
            "train.max_off_policy_steps": 1,
        },
    )
    train(cfg, show_progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        step = r["step"] - 1
        # the rollouts of step s start with version >= s - max_async_level; none is newer than s
        assert step - 1 <= r["rollout/version_min"] <= r["rollout/version_max"] <= step
        assert r["off_policy/token_staleness_max"] <= 1 and r["off_policy/dropped_frac"] == 0
    assert max(r["rollout/version_max"] for r in rows) >= 2  # new weights reached the rollout copy


class PublishMidEpisode:
    """Stands in for the learner's published weights: a new version appears after ``after`` polls
    (the rollout thread polls between decode steps), so it lands in the middle of running episodes."""

    def __init__(self, state, after: int) -> None:
        self.state, self.after, self.polls = state, after, 0

    def take_newer(self, than: int):
        self.polls += 1
        return (1, self.state) if self.polls > self.after and than < 1 else None


def test_async_token_sampled_after_a_mid_episode_update_carries_the_new_version(qwen, model_dirs, tmp_path):
    from kvstreams.train.async_rollouts import AsyncRollouts
    from kvstreams.train.rollouts import RolloutSource

    model, tok = qwen
    cfg = small_config(model_dirs["qwen3"], tmp_path, **{"train.asynchronous": "true", "train.steps": 1})
    new_state = {
        k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
        for k, v in model.state_dict().items()
    }
    copy_ = RolloutSource(copy.deepcopy(model), tok, cfg)
    producer = AsyncRollouts(copy_, cfg, 0, PublishMidEpisode(new_state, after=8))
    try:
        batch, _ = producer.get()
    finally:
        producer.close()
    for sample in batch.samples:
        v = sample.trace.weights_version[sample.trace.sampled_mask]
        assert v[0] == 0 and v[-1] == 1  # the episode ran across the update ...
        assert bool((v[1:] >= v[:-1]).all())  # ... and every token after it carries version 1
        assert int((v == 0).sum()) == 8  # the 8 decode steps before the update
    key = "model.layers.0.self_attn.q_proj.weight"  # (embeddings may be tied: loaded twice)
    assert torch.equal(copy_.model.state_dict()[key], new_state[key])


def test_stale_groups_are_dropped_whole():
    from kvstreams.cost import RolloutCost
    from kvstreams.trace import Trace
    from kvstreams.train.prepare import stale_groups
    from kvstreams.train.rollouts import RolloutBatch, Sample

    def trace(versions: list[int]) -> Trace:
        T = len(versions) + 1
        return Trace.from_record(
            list(range(T)),
            torch.full((1, 1, T), T),
            [False] + [True] * (T - 1),
            [False] + [True] * (T - 1),
            [math.nan] + [-1.0] * (T - 1),
            [versions[0], *versions],
            {"temperature": "1", "policy": "full", "mode": "stream", "model": "m"},
        )

    samples = [
        Sample(trace([5, 5, 6]), 0, 0, 1.0),
        Sample(trace([6, 6]), 0, 1, 0.0),  # fresh, but its group holds a token of version 5
        Sample(trace([6, 7]), 1, 2, 1.0),
        Sample(trace([7, 7]), 1, 3, 0.0),
    ]
    batch = RolloutBatch(samples, [1.0, 0.0, 1.0, 0.0], RolloutCost())
    stale, m = stale_groups(batch, step=7, max_off_policy_steps=1)
    assert stale == {0}  # group 0's oldest token is 2 versions old
    assert m["off_policy/dropped_frac"] == 0.5 and m["off_policy/dropped_tokens"] == 5
    assert m["off_policy/token_frac_0"] == pytest.approx(3 / 9) and m[
        "off_policy/token_frac_over"
    ] == pytest.approx(2 / 9)
    assert m["off_policy/token_staleness_max"] == 2
    assert stale_groups(batch, step=7, max_off_policy_steps=2)[0] == set()


def test_top_p_rollouts_stay_on_policy_and_a_learner_ignoring_truncation_shows_the_gap(
    qwen, model_dirs, tmp_path
):
    import dataclasses

    model, tok = qwen
    cfg = small_config(model_dirs["qwen3"], tmp_path, **{"rollout.top_p": 0.7, "rollout.top_k": 20})
    batch = RolloutSource(model, tok, cfg).collect(step=0)
    assert all(s.trace.top_p == 0.7 and s.trace.top_k == 20 for s in batch.samples)
    metrics = learner_step_then_restore(model, cfg, batch)
    assert metrics["mismatch/k3_kl"] < 1e-9 and metrics["ratio/first_update_max_abs_dev"] < 1e-4
    # the same rollouts scored without the truncation (the old learner): the metric exposes the gap
    untruncated = [
        dataclasses.replace(
            s, trace=dataclasses.replace(s.trace, metadata={**s.trace.metadata, "top_p": "1", "top_k": "0"})
        )
        for s in batch.samples
    ]
    metrics = learner_step_then_restore(model, cfg, dataclasses.replace(batch, samples=untruncated))
    assert metrics["mismatch/k3_kl"] > 1e-3 and metrics["mismatch/log_ppl_diff"] > 1e-2


def test_reprefill_baseline_trains_segments(qwen, model_dirs, tmp_path):
    model, tok = qwen
    cfg = small_config(
        model_dirs["qwen3"], tmp_path, **{"rollout.mode": '"reprefill"', "loss.type": '"reprefill"'}
    )
    batch = RolloutSource(model, tok, cfg).collect(step=0)
    assert len(batch.samples) > len(batch.rewards)  # several segments per episode
    metrics = learner_step_then_restore(model, cfg, batch)
    assert metrics["ratio/first_update_max_abs_dev"] < 1e-4
    assert metrics["mismatch/k3_kl"] < 1e-9


def test_a_reprefill_run_is_evaluated_in_reprefill_mode(qwen, model_dirs, tmp_path):
    """Each arm in its own mode: a model trained on re-prefilled segments (reset positions, KVs
    recomputed without the deleted span) is evaluated the same way, not in stream mode."""
    from kvstreams.experiments.measures import measure
    from kvstreams.train.evaluation import evaluate

    model, tok = qwen
    sets = {"rollout.mode": '"reprefill"', "loss.type": '"reprefill"', "train.eval_episodes": "2"}
    reprefill = RolloutSource(model, tok, small_config(model_dirs["qwen3"], tmp_path, **sets))
    stream = RolloutSource(model, tok, small_config(model_dirs["qwen3"], tmp_path))
    figures = [evaluate(source, 2, greedy=False) for source in (reprefill, stream)]
    forwarded = [f["eval/tokens_forwarded_per_episode"] for f in figures]
    assert forwarded[0] > forwarded[1]  # the retained turns were forwarded again after each compaction
    # and an experiment's measure reads an episode's last segment, where its final answer starts
    survival = measure("fact_survival", reprefill, 2)  # the same held-out episodes, sampled again
    assert survival["fact_survival_reward"] == figures[0]["eval/reward_mean"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stepz=3"], "train.stepz: Extra inputs"),
        (["train.steps=abc"], "train.steps"),
        (['loss.type="reprefill"'], "rollout.mode = 'reprefill'"),
        (['rollout.mode="reprefill"'], "loss.type = 'reprefill'"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (['loss.type="magic"'], "loss"),
        (['loss.correction="naive"'], "correction is now type"),
        (['loss.type="naive"', "loss.distill_coef=0.1"], "loss.naive.distill_coef"),
        (['loss.type="tis"', "loss.floor=3"], "floor must not exceed cap"),
        (
            ['rollout.strategy_preset="paper"'],
            "rollout: compaction strategy 'markovian' has no preset 'paper'",
        ),
        (["rollout.strategy_args={stride = 2}"], "has no option(s) stride"),
        (
            ['rollout.env="gsm8k"', 'rollout.policy="snapkv"', "rollout.policy_args={budget = 3.0}"],
            "fractional budget",
        ),
    ],
)
def test_bad_configs(overrides, message):
    with pytest.raises(KVStreamsError, match="bad config") as err:
        load_config(None, overrides)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "backend", "packed"),
    [
        ([], "blocksparse", True),  # CPU: the block-sparse kernel, traces packed in one row
        (['model.device="cuda"'], "flex", True),
        (['train.backend="sdpa"'], "sdpa", False),  # a dense mask over a packed row is quadratic
        (['train.backend="sdpa"', "optim.packed=true"], "sdpa", True),  # asked for: kept
    ],
)
def test_learner_backend_and_packing_defaults_are_resolved_in_the_config(overrides, backend, packed):
    cfg = load_config(None, overrides)
    assert (cfg.train.backend, cfg.optim.packed) == (backend, packed)
    assert f'backend = "{backend}"' in to_toml(cfg)  # config.json / config show state what runs


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
        return [float(lp[trained_positions(s.trace)].sum()) for lp, s in zip(lps, batch.samples, strict=True)]

    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        before = sequence_logp()
        Learner(model, cfg).step(items_of(batch, cfg))
        after = sequence_logp()
    finally:
        model.load_state_dict(state)
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    rewarded = [d for d, s in zip(deltas, batch.samples, strict=True) if batch.rewards[s.episode] > 0]
    others = [d for d, s in zip(deltas, batch.samples, strict=True) if batch.rewards[s.episode] == 0]
    assert min(rewarded) > 0 > max(others)


# --- training integrity: nothing non-finite is stepped on or checkpointed ----------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", ["optim.lr", "loss.kl_coef", "optim.grad_clip", "rollout.temperature"])
def test_non_finite_config_numbers_are_refused_when_the_config_loads(key, value):
    section, field = key.split(".")
    with pytest.raises(KVStreamsError, match=rf"bad config: {section}\.(shadow\.)?{field}"):
        load_config(None, [f"{key}={value}"])


def test_booleans_are_not_taken_for_numbers():
    with pytest.raises(KVStreamsError, match=r"bad config: train\.steps"):
        load_config(None, ["train.steps=true"])


def test_a_non_finite_loss_is_skipped_counted_and_never_stepped_on(
    qwen, model_dirs, tmp_path, compacted_batch, monkeypatch
):
    model, _ = qwen
    cfg = small_config(model_dirs["qwen3"], tmp_path, **{"rollout.group_size": 5})
    real = L.ppo_clip_loss
    monkeypatch.setattr(
        L, "ppo_clip_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), *real(*a, **k)[1:])
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = learner_step_then_restore_and_compare(model, cfg, compacted_batch, before)
    assert metrics["optim/nonfinite_skipped"] == 1.0
    monkeypatch.setattr(L, "ppo_clip_loss", real)
    metrics = learner_step_then_restore(model, cfg, compacted_batch)
    assert metrics["optim/nonfinite_skipped"] == 0.0


def learner_step_then_restore_and_compare(model, cfg, batch, before) -> dict[str, float]:
    """One learner step; asserts the weights did not move, then puts them back."""
    try:
        learner = Learner(model, cfg)
        metrics = learner.step(items_of(batch, cfg))
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed on a skipped step"
        return metrics
    finally:
        model.load_state_dict(before)


def test_non_finite_weights_are_never_checkpointed(model_dirs, tmp_path, monkeypatch):
    """An update that leaves a non-finite weight (here injected after AdamW's step) stops the run with
    one clear line before anything is checkpointed."""
    from kvstreams.loop import train
    from kvstreams.train.checkpoint import latest_checkpoint

    real_step = torch.optim.AdamW.step

    def breaking_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        self.param_groups[0]["params"][0].data[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", breaking_step)
    cfg = small_config(model_dirs["qwen3"], tmp_path, **{"train.eval_every": "0"})
    with pytest.raises(KVStreamsError, match="step 1: the update left non-finite weights"):
        train(cfg, show_progress=False)
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") is None


def test_a_huge_learning_rate_never_writes_nan_weights(model_dirs, tmp_path):
    """The report's case: lr = 1e6 with entropy_coef = 1 used to write NaN weights to step-*."""
    from safetensors.torch import load_file

    from kvstreams.loop import train

    overrides = {"optim.lr": "1e6", "loss.entropy_coef": "1.0", "train.steps": "3", "train.eval_every": "0"}
    cfg = small_config(model_dirs["qwen3"], tmp_path, **overrides)
    try:
        train(cfg, show_progress=False)
    except KVStreamsError as err:  # stopping is fine; a broken checkpoint is not
        assert "non-finite" in str(err)
    for weights in (tmp_path / "run" / "checkpoints").glob("step-*/*.safetensors"):
        assert all(bool(torch.isfinite(t).all()) for t in load_file(weights).values()), weights


def test_consecutive_non_finite_steps_stop_the_run(model_dirs, tmp_path, monkeypatch):
    from kvstreams.loop import train
    from kvstreams.train.checkpoint import latest_checkpoint

    real = L.ppo_clip_loss
    calls = {"n": 0}

    def nan_after_first_step(*args, **kwargs):
        pg, *rest = real(*args, **kwargs)
        calls["n"] += 1
        return (pg * float("nan") if calls["n"] > 1 else pg), *rest

    monkeypatch.setattr(L, "ppo_clip_loss", nan_after_first_step)
    overrides = {"train.steps": "5", "train.max_nonfinite_steps": "2", "train.eval_every": "0"}
    cfg = small_config(model_dirs["qwen3"], tmp_path, **overrides)
    with pytest.raises(KVStreamsError, match="step 3: 2 updates in a row skipped"):
        train(cfg, show_progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["optim/nonfinite_skipped"] for r in rows] == [0.0, 1.0]  # step 3 stopped before logging
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step-000001"


def test_group_advantages_leave_out_invalid_episodes():
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.0])
    valid = torch.tensor([True, True, False, True])
    adv = L.group_advantages(rewards, 4, normalize_std=False, valid=valid)
    mean = 1 / 3  # of the three valid rewards; the failed one's 5.0 does not count
    assert torch.allclose(adv, torch.tensor([1 - mean, -mean, 0.0, -mean]))


@pytest.mark.parametrize(
    ("env_args", "message"),
    [
        ('{n_turns = "abc"}', "option n_turns = 'abc' is not an integer"),
        ("{n_turns = -2}", "n_turns must be >= 1"),
        ("{n_facts = 0}", "n_facts must be >= 1"),
        ("{n_turns = true}", "is not an integer"),
    ],
)
def test_bad_environment_arguments_are_a_config_error(env_args, message):
    with pytest.raises(KVStreamsError, match="bad config: rollout: environment 'memory'") as err:
        load_config(None, [f"rollout.env_args={env_args}"])
    assert message in str(err.value)


def test_episodes_whose_environment_raises_are_dropped_counted_and_stop_the_run_when_most_fail(
    model_dirs, tmp_path, monkeypatch, capsys
):
    from kvstreams.envs.memory import MemoryEnv
    from kvstreams.loop import train

    real_step, real_reset = MemoryEnv.step, MemoryEnv.reset
    resets = {"n": 0, "fail_every": 4}

    def reset(self, seed):
        resets["n"] += 1
        self._fails = resets["n"] % resets["fail_every"] == 0
        return real_reset(self, seed)

    def step(self, reply):
        if self._fails:
            raise RuntimeError("simulated environment fault")
        return real_step(self, reply)

    monkeypatch.setattr(MemoryEnv, "step", step)
    monkeypatch.setattr(MemoryEnv, "reset", reset)
    cfg = small_config(model_dirs["qwen3"], tmp_path / "a", **{"train.eval_every": "0"})
    train(cfg, show_progress=False)  # one episode in four fails
    rows = [json.loads(x) for x in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/failed_frac"] == 0.25 for r in rows)
    assert all(r["tokens/trained"] > 0 for r in rows)
    err = capsys.readouterr().err
    assert err.count("simulated environment fault") == 1  # printed once, with its seed
    assert "seed " in err
    resets["fail_every"] = 1  # now every episode fails
    cfg = small_config(model_dirs["qwen3"], tmp_path / "b", **{"train.eval_every": "0"})
    with pytest.raises(
        KVStreamsError, match="step 1: 4 of 4 episodes failed in their environment; first: seed"
    ):
        train(cfg, show_progress=False)

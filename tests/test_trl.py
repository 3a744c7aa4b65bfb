"""The TRL plug-in (``kvstreams.integrations.trl``): TRL's GRPOTrainer learner replays kvstreams'
record, so its log-probs are kvstreams' shadow replay, while stock TRL on the same compressed
rollouts shows the dense gap. Skipped, with one line, when the ``[trl]`` extra is not installed."""

from __future__ import annotations

import os
import re

import pytest
import torch

pytest.importorskip("trl", reason="the [trl] extra is not installed (pip install -e '.[trl]')")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from peft import LoraConfig
from trl import GRPOConfig

from kvstreams.errors import KVStreamsError
from kvstreams.integrations import trl as plugin
from kvstreams.integrations.trl import KVStreamsGRPOTrainer, KVStreamsRollout
from kvstreams.models import load_model
from kvstreams.replay import replay_logprobs

SNAPKV = {"policy": "snapkv", "policy_args": {"budget": 0.5}}
SETTINGS = {
    "recall-snapkv": {"env": "recall", **SNAPKV},
    "memory-stream-snapkv": {
        "env": "memory",
        "strategy": "markovian",
        "mode": "stream",
        "max_reply_tokens": 12,
        **SNAPKV,
    },
}
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def token_share_reward(completions, completion_ids, **kwargs):
    """A reward the tiny random model varies on (the environments' rewards are 0 for it), so that
    the advantages, hence the updates, are not zero."""
    return [sum(t % 5 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def make_trainer(path, tmp_path, setting="recall-snapkv", steps=2, lora=False, config=None, **options):
    model, tokenizer = load_model(path)
    rollout = KVStreamsRollout(**SETTINGS[setting])
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        learning_rate=5e-2,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=3,
        **(config or {}),
    )
    return KVStreamsGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[rollout.reward, token_share_reward],
        rollout_func=rollout,
        train_dataset=rollout.dataset(range(8)),
        args=args,
        peft_config=LORA if lora else None,
        **options,
    )


def one_generation(trainer):
    """One TRL generation batch (rollout, rewards, advantages), as the training loop makes it."""
    rows = [trainer.train_dataset[i % 2] for i in range(8)]  # 2 tasks x 4 samples
    return trainer._generate_and_score_completions([dict(r) for r in rows])


def learner_logps(trainer, batch, stock=False):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].size(1)
    forward = super(KVStreamsGRPOTrainer, trainer) if stock else trainer
    with torch.no_grad():
        return forward._get_per_token_logps_and_entropies(trainer.model, ids, attention, width)[0]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_plugin_logprobs_are_kvstreams_shadow_replay_and_stock_trl_is_not(model_dirs, tmp_path, setting):
    trainer = make_trainer(model_dirs["qwen3"], tmp_path, setting)
    batch = one_generation(trainer)
    traces = trainer.kv_rollout.traces
    assert all(t.n_evicted > 0 for t in traces), "the rollouts must have evicted something"
    plugin_lp = learner_logps(trainer, batch)
    stock_lp = learner_logps(trainer, batch, stock=True)
    own = replay_logprobs(trainer.model, traces, mode="shadow")
    mask = plugin._trained_mask(batch).bool()
    assert int(mask.sum()) > 20
    width = batch["completion_ids"].size(1)
    plugin_gap, stock_gap = 0.0, 0.0
    for row, trace in enumerate(traces):
        first = int(trace.sampled_mask.nonzero()[0])
        n = len(trace) - first
        trained = mask[row, :n]
        ours = own[row][first:][trained]
        plugin_gap = max(plugin_gap, float((plugin_lp[row, :n][trained] - ours).abs().max()))
        stock_gap = max(stock_gap, float((stock_lp[row, :n][trained] - ours).abs().max()))
        # and both against what the sampler recorded
        sampler = trace.sampler_logprobs[first:][trained]
        assert float((plugin_lp[row, :n][trained] - sampler).abs().max()) < 1e-4
    print(f"{setting}: plug-in vs kvstreams' learner {plugin_gap:.1e}, stock TRL vs it {stock_gap:.3f}")
    assert width >= 1 and plugin_gap < 1e-4
    assert stock_gap > 0.05, "stock TRL's dense forward should not reproduce the compressed sampler"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_training_keeps_mismatch_at_float_level_while_dense_gap_stays(model_dirs, tmp_path, lora, setting):
    trainer = make_trainer(model_dirs["qwen3"], tmp_path, setting, steps=2, lora=lora, log_dense_gap=True)
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trained, strict=True)), "no update happened"
    steps = [h for h in trainer.state.log_history if "mismatch/abs_logprob_diff_max" in h]
    assert len(steps) == 2
    for h in steps:  # step 2 samples with the updated weights (LoRA: the adapter merged in the forward)
        print(
            {
                k: h[k]
                for k in ("mismatch/abs_logprob_diff_max", "mismatch/k3_kl", "dense_gap/abs_logprob_diff_max")
            }
        )
        assert h["mismatch/abs_logprob_diff_max"] < 1e-4
        assert h["mismatch/k3_kl"] < 1e-9
        assert h["sampling/sampling_logp_difference/max"] == h["mismatch/abs_logprob_diff_max"]
        assert h["dense_gap/abs_logprob_diff_max"] > 0.05
        assert h["dense_gap/k3_kl"] > 1e-3


def test_blocksparse_backend_and_a_reference_model_replay_too(model_dirs, tmp_path):
    """The block-sparse kernel (the CPU training default of kvstreams' own learner) under TRL, and
    beta > 0 without LoRA: TRL re-creates the reference model from the directory (with SDPA); the
    plug-in switches it to kvstreams' attention, so its log-probs are replayed as well."""
    trainer = make_trainer(
        model_dirs["qwen3"], tmp_path, "memory-stream-snapkv", backend="blocksparse", config={"beta": 0.04}
    )
    assert trainer.ref_model.config._attn_implementation == "kvstreams"
    trainer.train()
    steps = [h for h in trainer.state.log_history if "mismatch/abs_logprob_diff_max" in h]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-9)  # reference == policy before any update
    assert all(h["mismatch/abs_logprob_diff_max"] < 1e-4 for h in steps)


def test_dense_replay_is_stock_trl(model_dirs, tmp_path):
    trainer = make_trainer(model_dirs["qwen3"], tmp_path, replay="dense")
    batch = one_generation(trainer)
    assert torch.equal(learner_logps(trainer, batch), learner_logps(trainer, batch, stock=True))
    assert trainer.last_mismatch["mismatch/abs_logprob_diff_max"] > 0.05


def test_distillation_term_adds_to_trl_loss(model_dirs, tmp_path):
    """Same seed, same first rollouts: the logged loss is TRL's plus distill_coef x the distillation KL."""
    losses = {}
    for coef in (0.0, 0.5):
        trainer = make_trainer(model_dirs["qwen3"], tmp_path / str(coef), steps=1, distill_coef=coef)
        trainer.train()
        losses[coef] = trainer.state.log_history[0]
    distill = losses[0.5]["loss/distill"]
    assert distill > 1e-3 and "loss/distill" not in losses[0.0]
    assert losses[0.5]["loss"] == pytest.approx(losses[0.0]["loss"] + 0.5 * distill, abs=1e-4)


def test_rows_out_of_step_with_the_record_are_refused(model_dirs, tmp_path):
    trainer = make_trainer(model_dirs["qwen3"], tmp_path)
    batch = one_generation(trainer)
    trainer._rows = torch.arange(8).flip(0)  # rows 0..7 claim traces 7..0
    with pytest.raises(KVStreamsError, match="out of step"):
        learner_logps(trainer, batch)


def test_settings_that_would_break_the_replay_are_refused(model_dirs, tmp_path):
    with pytest.raises(KVStreamsError, match="GRPOConfig"):
        KVStreamsRollout(env="recall", temperature=0.7)
    with pytest.raises(KVStreamsError, match="reprefill"):
        KVStreamsRollout(env="memory", strategy="markovian", mode="reprefill")
    rollout = KVStreamsRollout(env="recall")
    with pytest.raises(KVStreamsError, match=r"rollout\.dataset"):
        rollout([[{"role": "user", "content": "hi"}]], trainer=None)
    model, tokenizer = load_model(model_dirs["qwen3"])
    args = GRPOConfig(output_dir=str(tmp_path), bf16=False, gradient_checkpointing=False, use_cpu=True,
                      report_to=[], top_k=5, per_device_train_batch_size=4, num_generations=4)  # fmt: skip
    with pytest.raises(KVStreamsError, match="top_k"):
        KVStreamsGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=rollout.reward,
                             rollout_func=rollout, train_dataset=rollout.dataset(range(4)), args=args)  # fmt: skip


def test_untested_trl_versions_fail_in_one_line(monkeypatch):
    monkeypatch.setattr(plugin.importlib.metadata, "version", lambda name: "1.17.0")
    with pytest.raises(KVStreamsError, match=r"tested with trl 1\.16\.x; found trl 1\.17\.0"):
        plugin.require_trl()


def test_example_runs_and_prints_both_mismatches(model_dirs, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"
    run = subprocess.run(
        [sys.executable, str(example), "--model", model_dirs["qwen3"], "--max-steps", "1", "--batch-size", "4",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    verdict = run.stdout.strip().splitlines()[-1]
    assert verdict.startswith("sampler vs learner, max |d log p| over steps:"), run.stdout[-1000:]
    trained, dense = (float(x) for x in re.findall(r"\d[\d.e+-]*", verdict.split("steps:")[1]))
    assert trained < 1e-4 and dense > 0.05

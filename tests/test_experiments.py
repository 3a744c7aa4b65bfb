"""``kvstreams experiment``: specs, statistics, the runner's resumability, the report, the probes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kvstreams.cli import main
from kvstreams.envs import make_env
from kvstreams.errors import KVStreamsError
from kvstreams.experiments import available, load_spec
from kvstreams.experiments.is_variance import sequence_log_weights, weight_figures
from kvstreams.experiments.measures import visible_before_last_reply
from kvstreams.experiments.report import summarise, time_to_target, write_report
from kvstreams.experiments.spec import ExperimentSpec
from kvstreams.stats import mean_interval
from kvstreams.trace import Trace

# --- statistics ---------------------------------------------------------------------------------------


def test_mean_interval_is_the_student_t_interval():
    iv = mean_interval([1.0, 2.0, 3.0])  # s = 1, t(0.975, 2) = 4.303
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.half_width == pytest.approx(4.303 / math.sqrt(3), rel=1e-6)
    assert (iv.low, iv.high) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    one = mean_interval([0.5])
    assert one.half_width is None and one.low is None and "1 seed" in one.text()
    assert mean_interval([0.25] * 40).half_width == 0.0  # df > 30: the normal quantile, times s = 0


# --- specs --------------------------------------------------------------------------------------------


def test_every_shipped_experiment_loads_and_validates_each_arm():
    names = available()
    assert {"smd-table", "compaction-speed", "recurrence-from-rl", "unseen-games", "is-variance"} <= set(
        names
    )
    for name in names:
        spec = load_spec(name)
        assert spec.name == name and spec.source and spec.question


def _spec(**changes) -> dict:
    data = {
        "name": "t",
        "title": "t",
        "source": "s",
        "question": "q",
        "model": "m",
        "base": {"rollout": {"env": "recall"}},
        "arms": [{"name": "a"}, {"name": "b", "set": {"optim.lr": 1e-3}}],
    }
    data.update(changes)
    return data


def test_a_bad_arm_is_one_line_naming_the_arm(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        'name = "bad"\ntitle = "t"\nsource = "s"\nquestion = "q"\nmodel = "m"\n'
        '[[arms]]\nname = "ok"\n[[arms]]\nname = "typo"\nset = { "optim.lrr" = 1e-3 }\n'
    )
    with pytest.raises(KVStreamsError, match=r"arm 'typo'.*optim\.lrr"):
        load_spec(str(path))
    with pytest.raises(KVStreamsError, match="unknown experiment 'nope'"):
        load_spec("nope")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"arms": [{"name": "a"}, {"name": "a"}]}, "repeat"),
        ({"arms": [{"name": "a", "groups": []}]}, "at least 1 item"),
        ({"reference_arm": "zzz"}, "reference_arm"),
        ({"quick": {"arms": ["zzz"]}}, "unknown arms"),
        ({"warm_start": {"arch": "qwen3"}}, "exactly one of model"),
        ({"evals": [{"name": "e", "measure": "telepathy"}]}, "unknown measure 'telepathy'"),
    ],
)
def test_inconsistent_specs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ExperimentSpec.model_validate(_spec(**changes))


def test_arm_overrides_apply_in_order_and_quick_comes_last(tmp_path):
    spec = ExperimentSpec.model_validate(_spec(quick={"set": {"optim.lr": 7e-4, "train.steps": 2}}))
    a, b = spec.arms
    assert spec.arm_config(a, 1, "m", tmp_path, quick=False).optim.lr == 2e-4  # the default
    assert spec.arm_config(b, 1, "m", tmp_path, quick=False).optim.lr == 1e-3
    cfg = spec.arm_config(b, 1, "m", tmp_path, quick=True)
    assert (cfg.optim.lr, cfg.train.steps, cfg.train.seed, cfg.train.out_dir) == (7e-4, 2, 1, str(tmp_path))


def test_runs_go_group_by_group_each_over_every_seed():
    """An experiment stopped early has its earlier groups complete and paired, in the spec's order."""
    from kvstreams.experiments.runner import plan_runs

    arms = [
        {"name": "a", "groups": ["main"]},
        {"name": "b", "groups": ["main"]},
        {"name": "c", "groups": ["second"]},
        {"name": "d", "groups": ["third"]},
        {"name": "e", "groups": ["second"]},
        {"name": "f", "groups": ["main", "third"]},  # runs once, with its first group
    ]
    spec = ExperimentSpec.model_validate(_spec(arms=arms))
    plan = [(arm.name, seed) for arm, seed in plan_runs(spec, quick=False, n_seeds=2)]
    assert plan == [
        ("a", 0), ("b", 0), ("f", 0), ("a", 1), ("b", 1), ("f", 1),
        ("c", 0), ("e", 0), ("c", 1), ("e", 1),
        ("d", 0), ("d", 1),
    ]  # fmt: skip


# --- report -------------------------------------------------------------------------------------------


def _run(arm: str, seed: int, start: float, end: float, seconds: float) -> dict:
    curve = [
        {"step": 0, "seconds": 0.0, "tokens": 0.0, "eval/reward_mean": start},
        {"step": 1, "seconds": seconds, "tokens": 100.0, "eval/reward_mean": (start + end) / 2},
        {"step": 2, "seconds": 2 * seconds, "tokens": 200.0, "eval/reward_mean": end},
    ]
    return {
        "arm": arm,
        "seed": seed,
        "seconds": 2 * seconds,
        "start": {"eval/reward_mean": start},
        "final": {"eval/reward_mean": end},
        "means": {},
        "curve": curve,
        "tokens_forwarded": 200.0,
        "evals": {},
    }


def test_time_to_target_is_the_first_crossing():
    run = _run("a", 0, 0.2, 0.8, seconds=10.0)
    assert time_to_target(run, 0.5) == {"seconds": 10.0, "tokens": 100.0, "step": 1}
    assert time_to_target(run, 0.8)["step"] == 2
    assert time_to_target(run, 0.9) is None


def test_comparisons_to_the_reference_are_paired_by_seed():
    spec = ExperimentSpec.model_validate(_spec(reference_arm="a", target_reward=0.5))
    results = [
        _run("a", 0, 0.2, 0.6, 10.0),
        _run("a", 1, 0.4, 0.8, 10.0),
        _run("b", 0, 0.2, 0.8, 5.0),
        _run("b", 1, 0.4, 1.0, 5.0),
    ]
    summary = summarise(spec, spec.arms, results)
    diff = summary["b"]["final vs reference (paired)"]  # 0.2 on both seeds, whatever the seeds' levels
    assert diff["mean"] == pytest.approx(0.2) and diff["half_width"] == pytest.approx(0.0, abs=1e-12)
    assert summary["b"]["gain"]["mean"] == pytest.approx(0.6)
    # seed 0: b reaches 0.5 at step 1 (5 s) where a needs step 2 (20 s); seed 1: both at step 1 (5 s, 10 s)
    ratio = summary["b"]["seconds to target / reference"]
    assert ratio["mean"] == pytest.approx((5 / 20 + 5 / 10) / 2)
    assert summary["b"]["reached target"] == "2/2"
    # the whole run's training time: b's steps took half as long on both seeds
    assert summary["b"]["train seconds / reference"]["mean"] == pytest.approx(0.5)
    assert summary["b"]["tokens forwarded / reference"]["mean"] == pytest.approx(1.0)


def test_a_max_metric_is_reported_as_its_mean_and_as_its_largest_step():
    """The table's `..._max` column is a mean of per-step maxima; the worst step of any seed is shown
    beside it, so one spike is not averaged away."""
    spec = ExperimentSpec.model_validate(_spec())
    runs = [_run("a", seed, 0.2, 0.5, 1.0) for seed in (0, 1)]
    for run, spikes in zip(runs, ([1e-6, 12.0], [2e-6, 3e-6]), strict=True):
        run["steps"] = [{"step": i + 1, "mismatch/abs_logprob_diff_max": x} for i, x in enumerate(spikes)]
        run["means"] = {"mismatch/abs_logprob_diff_max": sum(spikes) / 2}
    row = summarise(spec, spec.arms[:1], runs)["a"]
    assert row["mismatch/abs_logprob_diff_max"]["mean"] == pytest.approx((6.0 + 2.5e-6) / 2)
    assert row["mismatch/abs_logprob_diff_max (max over steps and seeds)"] == 12.0


def test_a_seed_whose_arms_started_from_different_weights_is_flagged_in_the_report(tmp_path):
    """A warm start rebuilt on another machine can differ (float rounding): the arms of that seed are not
    paired any more, and the report says so instead of pairing them silently."""
    spec = ExperimentSpec.model_validate(_spec(reference_arm="a"))
    results = [_run(arm, seed, 0.2, 0.5, 1.0) for arm in ("a", "b") for seed in (0, 1)]
    for r in results:
        r["warm_start"] = "f00d" if (r["arm"], r["seed"]) == ("b", 1) else f"seed{r['seed']}"
    payload = write_report(spec, spec.arms, results, tmp_path, "kvstreams experiment t")
    assert payload["unpaired_seeds"] == [1]
    assert "seed 1" in (tmp_path / "results.md").read_text().split("## ")[0]
    for r in results:  # the same weights for every arm of a seed (or runs from before it was recorded)
        r["warm_start"] = None if r["seed"] == 1 else "seed0"
    assert write_report(spec, spec.arms, results, tmp_path, "t")["unpaired_seeds"] == []
    assert "Not paired" not in (tmp_path / "results.md").read_text()


# --- the runner, through the command line --------------------------------------------------------------


def test_smd_table_quick_runs_resumes_and_reports(tmp_path, monkeypatch, capsys):
    out = tmp_path / "smd"
    assert main(["experiment", "smd-table", "--quick", "--out", str(out)]) == 0
    payload = json.loads((out / "results.json").read_text())
    runs = {r["arm"]: r for r in payload["runs"]}
    assert set(runs) == {"shadow", "naive"}
    # what the table reports is measured: the shadow learner replays the sampler, the naive one does not
    assert runs["shadow"]["means"]["mismatch/k3_kl"] < 1e-8
    assert runs["naive"]["means"]["mismatch/k3_kl"] > 1e-3
    # both arms of the seed started from the same weights, and the result says which
    assert (
        len(runs["shadow"]["warm_start"]) == 16
        and runs["naive"]["warm_start"] == runs["shadow"]["warm_start"]
    )
    assert 0.2 < runs["shadow"]["means"]["kv/saving"] < 0.6  # SnapKV dropping 50%
    assert [row["step"] for row in runs["naive"]["steps"]] == [0, 1, 2]  # every step's logged figures
    assert "loss/pg" in runs["naive"]["steps"][-1]
    assert (out / "reward_main.png").stat().st_size > 0
    assert "naive (GRPO w/ SnapKV)" in (out / "results.md").read_text()
    # a rerun reuses every finished run and the warm start: nothing is trained again
    import kvstreams.loop as loop
    import kvstreams.train.sft as sft

    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("a finished run was redone"))
    monkeypatch.setattr(sft, "sft", lambda *a, **k: pytest.fail("the warm start was redone"))
    assert main(["experiment", "smd-table", "--quick", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["runs"] == payload["runs"]


def test_smd_long_quick_evaluates_dense_and_measures_the_weights(tmp_path):
    out = tmp_path / "long"
    assert main(["experiment", "smd-long", "--quick", "--out", str(out)]) == 0
    runs = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    # the dense evaluation serves the trained weights without compression: nothing is evicted there
    for run in runs.values():
        assert run["evals"]["dense"]["eval/tasks"] == 2 and "eval/reward_mean" in run["evals"]["dense"]
        assert run["means"]["kv/saving"] > 0.05  # while training, SnapKV dropped entries
    # the shadow learner's importance weights are all 1 (ESS 1); the dense learner's are not
    assert runs["shadow"]["means"]["mismatch/ess"] == pytest.approx(1.0, abs=1e-9)
    assert runs["naive"]["means"]["mismatch/ess"] < 1 - 1e-4
    # two updates per batch: the ratio is measured on each, the clip fraction is logged
    assert all("clip/frac" in row for row in runs["naive"]["steps"] if row["step"] > 0)
    table = (out / "results.md").read_text()
    assert "dense: eval/reward_mean" in table and "mismatch/ess" in table and "dense: eval/tasks" not in table


def test_restore_lays_stored_runs_in_and_runs_only_the_missing_ones(tmp_path, monkeypatch):
    import gzip

    import kvstreams.loop as loop

    first = tmp_path / "first"
    assert main(["experiment", "smd-table", "--quick", "--out", str(first)]) == 0
    payload = json.loads((first / "results.json").read_text())
    stored = tmp_path / "stored.json.gz"
    kept = {**payload, "runs": [r for r in payload["runs"] if r["arm"] == "shadow"]}
    stored.write_bytes(gzip.compress(json.dumps(kept).encode()))
    trained = []
    real_train = loop.train
    monkeypatch.setattr(
        loop, "train", lambda cfg, **k: trained.append(cfg.train.out_dir) or real_train(cfg, **k)
    )
    second = tmp_path / "second"
    assert main(["experiment", "smd-table", "--quick", "--out", str(second), "--restore", str(stored)]) == 0
    assert [Path(d).parent.name for d in trained] == ["naive"]  # the stored shadow run is not redone
    runs = {r["arm"]: r for r in json.loads((second / "results.json").read_text())["runs"]}
    assert runs["shadow"]["final"] == kept["runs"][0]["final"]
    assert runs["shadow"]["steps"] == kept["runs"][0]["steps"]
    assert (
        main(["experiment", "smd-table", "--quick", "--out", str(tmp_path / "x"), "--restore", str(first)])
        == 2
    )
    # --report-only runs nothing: the report holds the restored run alone
    trained.clear()
    third = tmp_path / "third"
    argv = [
        "experiment",
        "smd-table",
        "--quick",
        "--out",
        str(third),
        "--restore",
        str(stored),
        "--report-only",
    ]
    assert main(argv) == 0 and trained == []
    assert [r["arm"] for r in json.loads((third / "results.json").read_text())["runs"]] == ["shadow"]


# --- is-variance ----------------------------------------------------------------------------------------


def _trace(sampler: list[float], sampled: list[bool], death: torch.Tensor | None = None) -> Trace:
    T = len(sampled)
    return Trace(
        tokens=torch.arange(T),
        positions=torch.arange(T),
        death=torch.full((1, 1, T), T) if death is None else death,
        sampled_mask=torch.tensor(sampled),
        loss_mask=torch.tensor(sampled),
        sampler_logprobs=torch.tensor(sampler),
        metadata={"temperature": "1.0"},
    )


def test_sequence_log_weights_sum_the_first_length_sampled_tokens():
    trace = _trace([math.nan, -1.0, -2.0, -3.0], [False, True, True, True])
    learner = torch.tensor([0.0, -1.5, -1.0, 0.0])
    log_w = sequence_log_weights([trace], [learner], 2)
    assert log_w.tolist() == pytest.approx([(-1.5 + 1.0) + (-1.0 + 2.0)])
    assert math.isnan(sequence_log_weights([trace], [learner], 4)[0])  # too short: left out
    figures = weight_figures(torch.tensor([0.0, math.log(3.0), math.nan], dtype=torch.float64))
    assert figures["n"] == 2 and figures["ess_frac"] == pytest.approx(16 / (2 * 10))


def test_is_variance_quick_dense_weights_vary_and_shadow_weights_are_one(tmp_path):
    out = tmp_path / "isv"
    assert main(["experiment", "is-variance", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "results.json").read_text())["summary"]["tiny"]
    for length in summary["dense"]:
        assert summary["shadow"][length]["var_log_w"]["mean"] < 1e-9
        assert summary["dense"][length]["var_log_w"]["mean"] > 1e-2
        assert summary["shadow"][length]["ess_frac"]["mean"] == pytest.approx(1.0)
    assert (out / "is_variance.png").stat().st_size > 0


# --- recurrence-from-rl and unseen-games pieces -----------------------------------------------------------


def test_visible_before_last_reply_is_what_the_final_answer_was_sampled_from():
    # tokens 0-1 prompt, 2 reply, 3-4 observation, 5-6 the last reply; entry 1 dies at query 3
    death = torch.tensor([[[7, 3, 7, 7, 7, 7, 7]]])
    trace = _trace([math.nan] * 7, [False, False, True, False, False, True, True], death)
    assert visible_before_last_reply(trace).tolist() == [0, 2, 3, 4]


def test_format_only_expert_answers_right_without_carrying_state():
    env = make_env("memory", n_turns=3, n_facts=2, expert_carries_state=False)
    env.reset(5)
    replies, reward, done = [], 0.0, False
    while not done:
        replies.append(env.expert_reply())
        _, reward, done, _ = env.step(replies[-1])
    assert all("<state></state>" in r for r in replies)
    assert reward == 1.0
    assert env.state_text() in replies[-1]


def test_textworld_game_set_cycles_training_games_and_evaluation_never_plays_them():
    env = make_env("textworld", game_set=4)
    assert [env.game_seed(s) for s in (0, 3, 4, 9)] == [0, 3, 0, 1]
    held = env.held_out()
    assert held.game_set == 0 and held.game_seed(1_000_003) == 1_000_003
    assert make_env("textworld").game_seed(9) == 9


def _runs(out) -> dict[str, dict]:
    return {r["arm"]: r for r in json.loads((out / "results.json").read_text())["runs"]}


def test_compaction_speed_quick_counts_what_each_mode_forwards(tmp_path):
    out = tmp_path / "speed"
    assert main(["experiment", "compaction-speed", "--quick", "--out", str(out)]) == 0
    runs = _runs(out)
    stream, reprefill = runs["stream-markovian"], runs["reprefill-markovian"]
    # the same episodes (same seeds, same start): re-prefill forwards the retained context again
    assert reprefill["tokens_forwarded"] > 1.2 * stream["tokens_forwarded"]
    assert stream["means"]["kv/saving"] > 0  # compaction happened in the quick setting too
    assert stream["curve"][-1]["seconds"] > 0 and stream["curve"][-1]["tokens"] == stream["tokens_forwarded"]
    assert (out / "reward_main.png").is_file()


def test_recurrence_quick_measures_fact_survival_under_compaction(tmp_path):
    out = tmp_path / "recurrence"
    assert main(["experiment", "recurrence-from-rl", "--quick", "--out", str(out)]) == 0
    runs = _runs(out)
    assert runs["no-compaction"]["means"]["kv/saving"] == 0.0
    assert runs["markovian"]["means"]["kv/saving"] > 0.0
    for run in runs.values():
        figures = run["evals"]["under compaction"]
        assert {"fact_survival", "fact_survival_reward", "eval/pass@1"} <= set(figures)


@pytest.mark.parametrize(("mode", "survives"), [("full", 1.0), ("stream", 0.0)])
def test_fact_survival_counts_a_fact_only_while_it_is_in_view(qwen, model_dirs, tmp_path, mode, survives):
    """A random model never restates the fact: it stays in view on every episode when nothing is
    compacted, and on none once Markovian compaction has deleted its message."""
    from kvstreams.experiments.measures import fact_survival
    from kvstreams.train.config import load_config
    from kvstreams.train.rollouts import RolloutSource

    model, tok = qwen
    sets = [f'model.path="{model_dirs["qwen3"]}"', f"rollout.mode={mode!r}", 'rollout.strategy="markovian"']
    sets += ["rollout.env_args={n_turns = 4, n_facts = 1, noise_words = 12}", "rollout.max_reply_tokens=16"]
    sets += ["rollout.strategy_args={token_budget = 160}", f'train.out_dir="{tmp_path}"']
    figures = fact_survival(RolloutSource(model, tok, load_config(None, sets)), 4)
    assert figures["fact_survival"] == survives


def test_unseen_games_quick_evaluates_the_harder_family(tmp_path):
    out = tmp_path / "unseen"
    assert main(["experiment", "unseen-games", "--quick", "--out", str(out)]) == 0
    run = _runs(out)["stream-markovian"]
    harder = run["evals"]["harder family"]
    # the quick setting's one held-out game, sampled once and played greedily once
    assert harder["eval/tasks"] == 1 and harder["eval/samples_per_task"] == 1
    assert harder["eval/reward_mean"] in (0.0, 1.0) and harder["eval/pass@1"] == harder["eval/reward_mean"]
    assert "harder family: eval/reward_mean" in (out / "results.md").read_text()


def test_command_line_overrides_reach_every_arm_and_bad_ones_stop_before_any_run(tmp_path):
    spec = load_spec("smd-table", {"optim.lr": 3e-5, "model.device": "cpu"})
    for arm in spec.arms:
        assert spec.arm_config(arm, 0, "m", tmp_path, quick=False).optim.lr == 3e-5
    assert main(["experiment", "smd-table", "--quick", "--device", "tpu", "--out", str(tmp_path / "x")]) == 2
    assert (
        main(["experiment", "smd-table", "--quick", "--set", "optim.lrr=1", "--out", str(tmp_path / "x")])
        == 2
    )
    assert not (tmp_path / "x" / "runs").exists()


def test_a_run_held_by_a_live_process_is_left_to_it_and_a_dead_holders_run_is_taken_over(tmp_path):
    import subprocess
    import sys

    from kvstreams.atomic import LOCK, claim, release

    hold = "import sys, time; from pathlib import Path; from kvstreams.atomic import claim; "
    hold += "claim(Path(sys.argv[1])); print('held', flush=True); time.sleep(float(sys.argv[2]))"
    held, orphan, fresh = tmp_path / "held", tmp_path / "orphan", tmp_path / "fresh"
    live = subprocess.Popen([sys.executable, "-c", hold, str(held), "30"], stdout=subprocess.PIPE, text=True)
    dead = subprocess.Popen([sys.executable, "-c", hold, str(orphan), "0"], stdout=subprocess.PIPE, text=True)
    dead.wait()  # it held the lock and died without releasing it (its file stays, with its pid)
    try:
        assert live.stdout.readline().strip() == "held" and (orphan / LOCK).read_text() == str(dead.pid)
        assert not claim(held)
        assert claim(orphan) and (orphan / LOCK).read_text() == str(__import__("os").getpid())
        assert claim(fresh)
        release(fresh)
        assert not (fresh / LOCK).exists()
    finally:
        live.kill()
        release(orphan)


def test_the_sanity_ladder_names_shipped_rungs_each_with_a_check():
    ladder = load_spec("rl-sanity")
    assert ladder.kind == "ladder" and ladder.rungs[0] == "rl-sanity-bandit"
    for rung in ladder.rungs:
        spec = load_spec(rung)
        assert spec.kind == "train" and spec.check is not None, rung
    with pytest.raises(ValidationError, match="ladder"):
        ExperimentSpec.model_validate({**_spec(), "kind": "ladder", "rungs": ["rl-sanity-bandit"]})


def test_the_report_gives_pass_at_1_and_pass_at_k_before_and_after_and_the_paired_gain():
    spec = ExperimentSpec.model_validate(_spec())

    def run(seed, before, after):
        figures = {"eval/reward_mean": 0.0, "eval/pass@1": before, "eval/pass@8": before + 0.4}
        final = {**figures, "eval/pass@1": after, "eval/pass@8": 1.0}
        return {
            "arm": "a",
            "seed": seed,
            "start": figures,
            "final": final,
            "means": {},
            "evals": {},
            "seconds": 1.0,
        }

    row = summarise(spec, spec.arms[:1], [run(0, 0.3, 0.7), run(1, 0.2, 0.8)])["a"]
    assert row["start eval/pass@1"]["mean"] == pytest.approx(0.25)
    assert row["final eval/pass@8"]["mean"] == 1.0
    assert row["pass@1 gain"]["mean"] == pytest.approx(0.5) and row["pass@1 gain"]["n"] == 2


def test_recall_memory_quick_evaluates_each_arm_without_training(tmp_path):
    out = tmp_path / "recall"
    assert main(["experiment", "recall-memory", "--quick", "--out", str(out)]) == 0
    runs = _runs(out)
    assert set(runs) == {"markovian", "recall-archive", "recall-recompute", "full"}
    for run in runs.values():
        assert run["start"] == {} and run["curve"] == []  # one evaluation, nothing trained
        assert {"eval/reward_mean", "eval/kv/visible_max_mean", "eval/recalls_per_episode"} <= set(
            run["final"]
        )
    assert runs["markovian"]["final"]["eval/recalls_per_episode"] == 0.0
    assert not (out / "runs" / "markovian" / "seed-0" / "checkpoints").exists()
    # compaction holds less than full context; recall may add back, never beyond full context
    held = {name: run["final"]["eval/kv/visible_max_mean"] for name, run in runs.items()}
    assert held["markovian"] < held["full"] and held["recall-archive"] <= held["full"]
    assert (out / "reward_main.png").is_file() and "final vs reference" in (out / "results.md").read_text()


def test_recall_rl_quick_trains_with_recall_and_evaluates_without(tmp_path):
    out = tmp_path / "recall-rl"
    assert main(["experiment", "recall-rl", "--quick", "--out", str(out)]) == 0
    runs = _runs(out)
    assert set(runs) == {"markovian", "recall"}
    assert runs["recall"]["final"]["eval/recalls_per_episode"] > 0
    assert runs["markovian"]["final"]["eval/recalls_per_episode"] == 0
    for run in runs.values():  # the evaluation without recall really ran without it
        assert run["evals"]["without recall"]["eval/recalls_per_episode"] == 0
    # the warm start's SFT validates with [warm_start] set (full context), not the first arm's mode
    spec = load_spec("recall-rl")
    assert spec.arms[0].name == "markovian"
    assert spec.arm_config(spec.warm_start_arm(), 0, "m", tmp_path, False).rollout.mode == "full"
    other = load_spec("recurrence-discoverable")  # no [warm_start] set: the first arm's config
    assert other.warm_start_arm() is other.arms[0]


def test_an_experiment_on_an_unconverted_pretrained_model_says_what_to_run(tmp_path, monkeypatch):
    from kvstreams.experiments.runner import warm_start

    monkeypatch.setenv("KVSTREAMS_CACHE", str(tmp_path / "empty-cache"))
    spec = load_spec("real-grpo")
    assert spec.model == "smollm2"
    with pytest.raises(KVStreamsError, match="make real-model"):
        warm_start(spec, 0, tmp_path / "models", quick=True, log=print)
    assert warm_start(spec.model_copy(update={"model": "some/dir"}), 0, tmp_path, True, print) == "some/dir"


@pytest.mark.slow
@pytest.mark.real_model
def test_real_grpo_quick_trains_smollm2_and_serves_it_dense(tmp_path):
    from kvstreams import pretrained

    if not pretrained.cached(pretrained.default_dir("smollm2"), pretrained.PRETRAINED["smollm2"]):
        pytest.skip("the real model is not converted here (make real-model)")
    out = tmp_path / "real"
    assert main(["experiment", "real-grpo", "--quick", "--out", str(out)]) == 0
    runs = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert runs["shadow"]["means"]["mismatch/ess"] == pytest.approx(1.0, abs=1e-6)
    assert (
        runs["naive"]["means"]["mismatch/k3_kl"] > 1e-4
    )  # the dense learner did not see the sampler's cache
    assert all("eval/pass@1" in run["evals"]["dense"] for run in runs.values())

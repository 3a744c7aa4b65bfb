"""The command line: the happy path end to end, and one clear line for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstreams.cli import main
from kvstreams.trace import Trace


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse errors
        return int(exit_.code)


def test_rollout_inspect_verify(model_dirs, tmp_path, capsys):
    out = tmp_path / "traces"
    rc = run(
        [
            "rollout",
            "--model",
            model_dirs["qwen3"],
            "--policy",
            "h2o",
            "--budget",
            "48",
            "--episodes",
            "3",
            "--prompt-len",
            "40",
            "--max-new-tokens",
            "60",
            "--batch-size",
            "2",
            "--no-stop",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    files = sorted(out.glob("trace-*.safetensors"))
    assert len(files) == 3
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["episodes"] == 3 and summary["tokens_trace"] == 300 and summary["kv_capacity_entries"] == 48
    )
    trace = Trace.load(files[0])
    assert len(trace) == 100 and trace.metadata["policy"] == "h2o" and trace.n_evicted > 0
    traces = [Trace.load(f) for f in files]
    assert summary["traces"] == [f.name for f in files]
    assert summary["tokens_trace"] == sum(len(t) for t in traces)
    assert summary["tokens_sampled"] == 3 * 60  # --no-stop: every sequence samples max-new-tokens
    assert summary["rewards"] is None and summary["reward_mean"] is None  # no environment, no rewards
    assert summary["budget_entries"] == [48]  # the last batch holds the third sequence alone
    for t, events, saving in zip(traces, summary["eviction_events"], summary["kv_saving"], strict=True):
        # interval 1: once 48 entries are cached, every further token evicts one entry per layer and head
        assert events == len(t) - 48 and t.n_evicted == events * t.death.shape[0] * t.death.shape[1]
        assert 0 < saving < 1 and saving == round(t.kv_saving(), 4)
    assert summary["kv_saving_mean"] == pytest.approx(sum(t.kv_saving() for t in traces) / 3)

    assert run(["inspect", *map(str, files)]) == 0
    assert "trace-00002" in capsys.readouterr().out

    report = tmp_path / "verify.json"
    rc = run(
        [
            "verify",
            "--model",
            model_dirs["llama"],
            "--policy",
            "recent",
            "--policy",
            "knorm",
            "--compression",
            "30%",
            "--episodes",
            "2",
            "--prompt-len",
            "40",
            "--max-new-tokens",
            "100",
            "--json",
            str(report),
        ]
    )
    assert rc == 0
    data = json.loads(report.read_text())
    assert [r["name"] for r in data["reports"]] == ["recent", "knorm"]
    assert data["floor"] is None and data["dtype"] == "float32" and data["env"] is None
    for r in data["reports"]:
        assert r["passed"] and r["shadow"]["max_abs_diff"] <= 1e-4 < r["dense"]["max_abs_diff"]
        assert 0.2 < r["kv_saving"] < 0.3  # 30% dropped per sequence, within what one interval lets grow
        assert r["sequences"] == 2 and r["tokens"] == 2 * 140 and r["sampled_tokens"] == 2 * 100
        assert 0 < r["min_events_per_sequence"] <= r["eviction_events"] / 2 and r["evicted_entries"] > 0
        assert "within_2x_floor" not in r  # no floor measured, no verdict against it
    recent, knorm = data["reports"]
    assert knorm["eviction_events"] < recent["eviction_events"]  # knorm frees 16 entries a round, recent 1
    assert "recent" in capsys.readouterr().out


@pytest.fixture
def bad_model_dir(tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    return d


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rollout", "--policy", "nope"], "unknown policy 'nope'"),
        (["rollout", "--budget", "abc"], "bad budget"),
        (["rollout", "--budget", "1.5"], "fractional budget"),
        (["rollout", "--budget", "0.5", "--compression", "0.5"], "not both"),
        (["rollout", "--compression", "120%"], "--compression must be a share"),
        (["rollout", "--episodes", "0"], "must be positive"),
        (["rollout", "--top-p", "2"], "(0, 1]"),
        (["rollout", "--policy", "snapkv", "--budget", "40"], "too small"),
        (["rollout", "--policy-arg", "windowless"], "key=value"),
        (["rollout", "--policy", "h2o", "--policy-arg", "n_sink=3"], "has no option"),
        (["rollout", "--device", "cuda"], "no CUDA device"),
        (["rollout", "--prompt-len", "3"], "--prompt-len must exceed"),
    ],
)
def test_bad_rollout_values(model_dirs, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    rc = run([*argv, "--model", model_dirs["qwen3"], "--out", str(out), "--max-new-tokens", "8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_bad_models(tmp_path, bad_model_dir, capsys):
    for model, message in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path, "no config.json"),
        (bad_model_dir, "not supported"),
    ]:
        rc = run(["verify", "--model", str(model)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and message in err and len(err.splitlines()) == 1


def test_bad_trace_and_tiny_model_values(tmp_path, capsys):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"garbage")
    assert run(["inspect", str(junk)]) == 2
    assert "not a readable safetensors" in capsys.readouterr().err
    assert run(["tiny-model", "--out", str(tmp_path / "m"), "--hidden", "130", "--heads", "4"]) == 2
    assert "divisible" in capsys.readouterr().err
    assert run(["tiny-model", "--out", str(tmp_path / "m"), "--arch", "gpt2"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_console_entry_point_reports_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvstreams", "verify", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"kvstreams verify: error: model directory '{tmp_path / 'nope'}' does not exist"
    )


def test_episode_rollouts_write_traces_and_summary(model_dirs, tmp_path):
    out = tmp_path / "reprefill"
    rc = run(
        [
            "rollout",
            "--model",
            model_dirs["qwen3"],
            "--env",
            "memory",
            "--env-arg",
            "n_turns=6",
            "--strategy",
            "markovian",
            "--mode",
            "reprefill",
            "--episodes",
            "2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "tokens_forwarded",
        "tokens_reprefilled",
        "tokens_filler",
        "tokens_trace",
        "kv_peak_entries",
        "kv_peak_bytes",
        "compactions",
        "tokens_reprefilled_predicted",
    ):
        assert key in summary, key
    assert summary["tokens_reprefilled"] > 0 and summary["compactions"] >= 2
    segments = sorted(out.glob("episode-00000-seg*.safetensors"))
    assert len(segments) == summary["episode_results"][0]["segments"] >= 2
    files = sorted(out.glob("episode-*.safetensors"))
    assert summary["traces"] == [f.name for f in files] and summary["episodes"] == 2
    assert summary["tokens_trace"] == sum(len(Trace.load(f)) for f in files)
    results = summary["episode_results"]
    assert [r["seed"] for r in results] == [0, 1]
    assert summary["compactions"] == sum(r["compactions"] for r in results)
    assert all(r["segments"] == r["compactions"] + 1 for r in results)  # each compaction starts a segment
    assert 0 < summary["tokens_reprefilled"] < summary["tokens_forwarded"]
    assert summary["kv_peak_entries"] > 0 and summary["kv_peak_bytes"] > 0
    assert Trace.load(segments[1]).metadata["mode"] == "reprefill"

    out = tmp_path / "stream"
    rc = run(
        [
            "rollout",
            "--model",
            model_dirs["qwen3"],
            "--env",
            "memory",
            "--env-arg",
            "n_turns=6",
            "--strategy",
            "summary",
            "--episodes",
            "1",
            "--block-size",
            "16",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "stream" and summary["tokens_reprefilled"] == 0 and summary["tokens_filler"] > 0
    assert "tokens_reprefilled_predicted" not in summary
    assert [p.name for p in out.glob("*.safetensors")] == ["episode-00000.safetensors"]
    (result,) = summary["episode_results"]
    assert result["segments"] == 1 and result["compactions"] == summary["compactions"] > 0
    assert summary["tokens_trace"] == len(Trace.load(out / "episode-00000.safetensors"))


def test_single_turn_env_rollout_reports_rewards(model_dirs, tmp_path, gsm8k_path):
    out = tmp_path / "gsm"
    rc = run(
        [
            "rollout",
            "--model",
            model_dirs["qwen3"],
            "--env",
            "gsm8k",
            "--env-arg",
            f"path={gsm8k_path}",
            "--policy",
            "h2o",
            "--episodes",
            "2",
            "--max-new-tokens",
            "40",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["rewards"]) == 2 and all(r in (0.0, 1.0) for r in summary["rewards"])
    assert summary["reward_mean"] == sum(summary["rewards"]) / 2 and summary["env"] == "gsm8k"
    assert summary["tokens_sampled"] <= 2 * 40
    # the default budget keeps half of each sequence: every sequence evicts and saves about half
    assert all(e > 0 for e in summary["eviction_events"]) and len(summary["budget_entries"]) == 2
    assert all(0.3 < s < 0.55 for s in summary["kv_saving"])


def test_verify_strategies(model_dirs, tmp_path):
    report = tmp_path / "v.json"
    rc = run(
        [
            "verify",
            "--model",
            model_dirs["llama"],
            "--env",
            "memory",
            "--env-arg",
            "n_turns=8",
            "--strategy",
            "sliding_window",
            "--episodes",
            "1",
            "--json",
            str(report),
        ]
    )
    assert rc == 0
    (r,) = json.loads(report.read_text())["reports"]
    assert r["kind"] == "strategy" and r["passed"] and r["eviction_events"] >= 3
    assert r["sequences"] == 1 and r["min_events_per_sequence"] == r["eviction_events"]
    assert 0 < r["sampled_tokens"] < r["tokens"] and r["evicted_entries"] > 0 and 0 < r["kv_saving"] < 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rollout", "--mode", "reprefill"], "needs a compaction strategy"),
        (
            ["rollout", "--strategy", "summary", "--policy", "h2o", "--policy-arg", "budget_of=context"],
            "context",
        ),
        (["rollout", "--strategy", "nope"], "unknown compaction strategy"),
        (["rollout", "--strategy", "summary", "--env", "chess"], "unknown environment"),
        (["rollout", "--strategy", "markovian", "--token-budget", "40"], "not below the budget"),
        (["rollout", "--strategy", "markovian", "--strategy-arg", "keep_tokens=0"], "keep_tokens"),
        (["rollout", "--strategy", "summary", "--mode", "sideways"], "invalid choice"),
        (["verify", "--strategy", "summary", "--policy", "h2o", "--budget", "1.0"], "keeps everything"),
    ],
)
def test_bad_episode_values(model_dirs, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    extra = ["--out", str(out)] if argv[0] == "rollout" else []
    rc = run([*argv, "--model", model_dirs["qwen3"], "--episodes", "1", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_verify_floor_names_the_precision_it_measured(model_dirs, tmp_path, capsys):
    """The rounding columns say which precision they are: bfloat16 runs are not labelled fp32."""
    argv = ["verify", "--model", model_dirs["qwen3"], "--policy", "snapkv", "--floor", "--episodes", "1"]
    argv += ["--prompt-len", "32", "--max-new-tokens", "16", "--dtype", "bfloat16"]
    run([*argv, "--json", str(tmp_path / "v.json")])
    out = capsys.readouterr().out
    assert "learner bf16" in out and "fp32" not in out.split("floor:")[0]
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["dtype"] == "bfloat16" and report["floor"] is not None
    assert report["reports"][0]["exact_gap"] < 1e-5  # float64 re-run: the record itself is exact


def test_the_old_token_budget_flag_still_works_and_warns(model_dirs, tmp_path, capsys):
    code = main(
        ["rollout", "--model", str(model_dirs["qwen3"]), "--strategy", "markovian", "--compact-budget", "40",
         "--out", str(tmp_path / "out")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert "--compact-budget is now --token-budget" in err
    assert code == 2 and "not below the budget B = 40" in err  # read as the token budget

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
    assert [r["policy"] for r in data["reports"]] == ["recent", "knorm"]
    for r in data["reports"]:
        assert r["passed"] and r["shadow"]["max_abs_diff"] <= 1e-4 < r["dense"]["max_abs_diff"]
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
        (["rollout", "--episodes", "0"], "must be positive"),
        (["rollout", "--top-p", "2"], "top_p"),
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

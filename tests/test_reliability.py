"""Reliability of runs on disk: checkpoint corruption and fallback, resume rules (finished runs,
config drift), orphaned temporary checkpoints, cut-off metrics, one process per run directory,
``kill -9`` at random moments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvstreams.atomic import sha256
from kvstreams.errors import KVStreamsError
from kvstreams.loop import train
from kvstreams.train.checkpoint import checkpoint_problem
from kvstreams.train.metrics import MetricsLog
from test_train import small_config


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "bit flip in the weights": lambda c: _flip_byte(c / "model.safetensors"),
    "truncated weights": lambda c: (c / "model.safetensors").write_bytes(
        (c / "model.safetensors").read_bytes()[:100]
    ),
    "random optimizer file": lambda c: (c / "optimizer.safetensors").write_bytes(os.urandom(512)),
    "negative step": lambda c: (c / "state.json").write_text(
        json.dumps({**json.loads((c / "state.json").read_text()), "step": -1})
    ),
    "truncated weights, no checksums (older checkpoint)": lambda c: (
        (c / "checksums.json").unlink(),
        (c / "model.safetensors").write_bytes(b"\x00" * 16),
    ),
    "wrong RNG tensor, no checksums": lambda c: (
        (c / "checksums.json").unlink(),
        __import__("safetensors.torch").torch.save_file(
            {"torch_cpu": __import__("torch").zeros(3)}, str(c / "rng.safetensors")
        ),
    ),
}


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(
    corruption, two_steps, model_dirs, tmp_path, capsys
):
    root = _copy(two_steps, tmp_path / "r")
    newest = root / "run" / "checkpoints" / "step-000001"
    CORRUPTIONS[corruption](newest)
    cfg = small_config(model_dirs["qwen3"], root, **{"train.eval_every": "0", "train.steps": "3"})
    train(cfg, resume=True, show_progress=False)
    err = capsys.readouterr().err
    assert "passed over checkpoint step-000001" in err and "resuming from step-000000" in err
    assert [r["step"] for r in _rows(root / "run")] == [1, 2, 3]  # step 2 redone from step 1's state


def test_checkpoint_problems_name_what_is_wrong(two_steps, tmp_path):
    root = _copy(two_steps, tmp_path / "r")
    c = root / "run" / "checkpoints" / "step-000001"
    assert checkpoint_problem(c) is None
    _flip_byte(c / "model.safetensors")
    assert checkpoint_problem(c) == "model.safetensors does not match its checksum"
    (c / "checksums.json").unlink()
    assert checkpoint_problem(c).startswith("no checksums.json")
    (c / "state.json").write_text(json.dumps({"step": "x"}))
    sums = {f.name: sha256(f) for f in c.iterdir()}
    (c / "checksums.json").write_text(json.dumps(sums))  # digests that match: the step is still invalid
    assert "invalid step 'x'" in checkpoint_problem(c)
    f = root / "run" / "checkpoints" / "step-000009"
    f.write_text("a file where a checkpoint directory should be")
    assert checkpoint_problem(f) == "not a directory"


def test_no_readable_checkpoint_is_one_line_listing_each(two_steps, model_dirs, tmp_path):
    root = _copy(two_steps, tmp_path / "r")
    for c in (root / "run" / "checkpoints").glob("step-*"):
        _flip_byte(c / "model.safetensors")
    cfg = small_config(model_dirs["qwen3"], root, **{"train.steps": "3"})
    with pytest.raises(KVStreamsError, match=r"no readable checkpoint.*step-000001.*step-000000"):
        train(cfg, resume=True, show_progress=False)


def test_resuming_a_finished_run_says_it_is_finished(two_steps, model_dirs, tmp_path):
    root = _copy(two_steps, tmp_path / "r")
    cfg = small_config(model_dirs["qwen3"], root, **{"train.eval_every": "0", "train.keep_last": "2"})
    with pytest.raises(KVStreamsError, match=r"is finished \(2 of train.steps = 2"):
        train(cfg, resume=True, show_progress=False)


def test_config_drift_is_refused_unless_allowed_and_then_recorded(two_steps, model_dirs, tmp_path):
    root = _copy(two_steps, tmp_path / "r")
    changed = {"train.eval_every": "0", "train.steps": "3", "optim.lr": "5e-4", "rollout.group_size": "2"}
    cfg = small_config(model_dirs["qwen3"], root, **changed)
    with pytest.raises(KVStreamsError, match=r"optim.lr: 0.001 -> 0.0005.*rollout.group_size: 4 -> 2"):
        train(cfg, resume=True, show_progress=False)
    # more steps, another eval schedule: not a change of the optimisation
    same = small_config(model_dirs["qwen3"], _copy(two_steps, tmp_path / "s"), **{"train.steps": "3"})
    train(same, resume=True, show_progress=False)
    train(cfg, resume=True, show_progress=False, allow_config_change=True)
    record = json.loads((root / "run" / "config_changes.jsonl").read_text())
    assert record["step"] == 2 and record["changes"]["optim.lr"] == [1e-3, 5e-4]
    assert json.loads((root / "run" / "config.json").read_text())["optim"]["lr"] == 5e-4


def test_orphaned_temporary_checkpoints_are_removed_at_start(two_steps, model_dirs, tmp_path, capsys):
    root = _copy(two_steps, tmp_path / "r")
    orphan = root / "run" / "checkpoints" / ".step-000002.abc123"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"partial")
    cfg = small_config(model_dirs["qwen3"], root, **{"train.eval_every": "0", "train.steps": "3"})
    train(cfg, resume=True, show_progress=False)
    assert not orphan.exists() and "removed .step-000002.abc123" in capsys.readouterr().err


def test_a_cut_off_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.log(0, {"a": 1.0})
    log.log(1, {"a": 2.0})
    with log.path.open("a") as f:
        f.write('{"step": 2, "a": 3')  # the process died mid-write
    assert [r["step"] for r in log.read()] == [0, 1]
    assert "dropped a cut-off last line" in capsys.readouterr().err
    MetricsLog(tmp_path, tensorboard=False, keep_until=1)  # resuming rewrites the file whole
    assert log.path.read_text().endswith("}\n") and len(log.read()) == 2
    log.path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(KVStreamsError, match="line 2 is not JSON"):
        log.read()


def test_two_runs_never_share_an_out_dir(model_dirs, tmp_path):
    run = tmp_path / "run"
    hold = "import sys, time; from pathlib import Path; from kvstreams.atomic import claim; "
    hold += "claim(Path(sys.argv[1]), 'train.lock'); print('held', flush=True); time.sleep(30)"
    sleeper = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "held"
        cfg = small_config(model_dirs["qwen3"], tmp_path)
        with pytest.raises(
            KVStreamsError, match=f"in use by another kvstreams train \\(pid {sleeper.pid}\\)"
        ):
            train(cfg, show_progress=False)
    finally:
        sleeper.kill()


def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_run(model_dirs, tmp_path):
    """A subprocess `kvstreams train` killed with SIGKILL twice, resumed each time, ends with the
    same per-step figures as a run never interrupted (checkpoint every step). Each kill comes once the
    run has logged a given number of steps (not after a fixed delay: on idle cores the whole run
    finished inside the delay and the kill interrupted nothing)."""
    sets = [
        f'model.path="{model_dirs["qwen3"]}"',
        "rollout.env_args={n_turns = 4, n_facts = 1, noise_words = 12}",
        "rollout.prompts_per_step=1",
        "rollout.group_size=4",
        "rollout.max_reply_tokens=16",
        "rollout.strategy_args={token_budget = 160}",
        "train.steps=6",
        "train.eval_every=0",
        "train.tensorboard=false",
        "train.plots=false",
        "optim.lr=1e-3",
    ]

    def command(out, resume=False):
        args = [sys.executable, "-m", "kvstreams.cli", "train", *[a for s in sets for a in ("--set", s)]]
        return [*args, "--set", f'train.out_dir="{out}"'] + (["--resume"] if resume else [])

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command(tmp_path / "straight"), check=True, env=env, capture_output=True)
    killed = tmp_path / "killed"
    resume = False
    for steps_logged in (2, 4):  # then killed: inside a step, a checkpoint write or the next rollout
        p = subprocess.Popen(
            command(killed, resume), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 600
        while p.poll() is None and time.monotonic() < deadline:
            metrics = killed / "metrics.jsonl"  # complete lines only: one may be half written
            if metrics.is_file() and metrics.read_text().count("\n") >= steps_logged:
                break
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert not (killed / "summary.json").exists()  # the kill did interrupt the run
        resume = (killed / "checkpoints").is_dir() and any((killed / "checkpoints").glob("step-*"))
    subprocess.run(command(killed, resume), check=True, env=env, capture_output=True)
    straight, again = _rows(tmp_path / "straight"), _rows(killed)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(straight, again, strict=True):
        for key in ("loss/pg", "reward/mean", "entropy/mean", "tokens/forwarded"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


# --- the command line: bad inputs are one line before any work ------------------------------------------


def _cli(argv, capsys) -> tuple[int, str]:
    from kvstreams.cli import main

    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's refusals
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["verify", "--mode", "stream"], "--model"),  # never an abbreviation of --model
        (["rollout", "--model", "M", "--out", "O", "--temperature", "nan"], "finite"),
        (["rollout", "--model", "M", "--out", "O", "--temperature", "inf"], "finite"),
        (["rollout", "--model", "M", "--out", "O", "--top-p", "1.5"], "(0, 1]"),
        (["rollout", "--model", "M", "--out", "O", "--device", "tpu"], "not a torch device"),
        (["rollout", "--model", "M", "--out", "O", "--top-k", "-1"], ">= 0"),
    ],
)
def test_bad_command_line_values_are_refused_by_the_parser(argv, message, capsys):
    code, err = _cli(argv, capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_outputs_are_checked_before_any_work(model_dirs, tmp_path, capsys):
    model = model_dirs["qwen3"]
    code, err = _cli(["tiny-model", "--out", model], capsys)
    assert code == 2 and "--force" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = _cli(["verify", "--model", model, "--json", str(blocker / "r.json")], capsys)
    assert code == 2 and "--json" in err and "not writable" in err
    out = tmp_path / "traces"
    base = ["rollout", "--model", model, "--policy", "snapkv", "--episodes", "1", "--max-new-tokens", "4"]
    assert _cli([*base, "--out", str(out)], capsys)[0] == 0
    code, err = _cli([*base, "--out", str(out)], capsys)  # a second rollout must not mix with the first
    assert code == 2 and "earlier rollout" in err
    code, err = _cli([*base[:-1], "40000", "--out", str(tmp_path / "long")], capsys)
    assert code == 2 and "max_position_embeddings" in err


def test_a_config_that_is_not_utf8_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[train]\nsteps = 2 # \xff\xfe\n")
    code, err = _cli(["train", "--config", str(bad)], capsys)
    assert code == 2 and "not UTF-8" in err


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    import kvstreams.cli as cli

    def broken(args):
        raise ValueError("something nobody foresaw\nsecond line")

    monkeypatch.setitem(cli.COMMANDS, "inspect", broken)
    code, err = _cli(["inspect", "x"], capsys)
    assert code == 1 and err == (
        "kvstreams inspect: unexpected error: ValueError: something nobody foresaw "
        "(run with --debug for the traceback)"
    )
    with pytest.raises(ValueError):
        cli.main(["--debug", "inspect", "x"])


# --- model directories ----------------------------------------------------------------------------------


def _edit_config(d, **changes):
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))


def _bigger_tokenizer(d):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    tok.add_tokens([f"extra{i}" for i in range(600)])
    tok.save_pretrained(d)


MODEL_CASES = {
    "config not an object": (lambda d: (d / "config.json").write_text("[1, 2]"), "not a JSON object"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{"), "cannot read"),
    "zero heads": (
        lambda d: _edit_config(d, num_attention_heads=0),
        "num_attention_heads must be a positive",
    ),
    "missing key": (
        lambda d: _edit_config(d, hidden_size=None),
        "hidden_size must be a positive integer, got None",
    ),
    "mistyped key": (lambda d: _edit_config(d, num_hidden_layers="four"), "got 'four'"),
    "heads do not divide": (lambda d: _edit_config(d, num_key_value_heads=3), "not a multiple"),
    "truncated weights": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
        "cannot load model",
    ),
    "missing tokenizer": (
        lambda d: [f.unlink() for f in d.iterdir() if f.name.startswith(("tokenizer", "special_tokens"))],
        "has no tokenizer",
    ),
    "tokenizer larger than the vocabulary": (_bigger_tokenizer, "the tokenizer has"),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_broken_model_directories_are_one_line(case, model_dirs, tmp_path):
    from kvstreams.models import load_model

    d = _copy(model_dirs["qwen3"], tmp_path / "m")
    edit, message = MODEL_CASES[case]
    edit(d)
    with pytest.raises(KVStreamsError, match=message) as err:
        load_model(d)
    assert "\n" not in str(err.value)


def test_more_steps_are_a_change_only_when_they_stretch_the_schedule():
    from kvstreams.train.checkpoint import config_changes

    old = {"train": {"steps": 2, "eval_every": 1}, "optim": {"schedule": "constant", "lr": 1e-3}}
    assert config_changes(old, {**old, "train": {"steps": 9, "eval_every": 3}}) == {}
    cosine = {**old, "optim": {"schedule": "cosine", "lr": 1e-3}}
    assert config_changes(cosine, {**cosine, "train": {"steps": 9, "eval_every": 1}}) == {
        "train.steps": [2, 9]
    }

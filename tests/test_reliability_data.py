"""Reliability, second pass: nothing lost and nothing silently wrong on disk (models, checkpoints).

Each test reproduces a case that was found losing data or loading wrong weights without a word."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstreams.atomic import sha256
from kvstreams.errors import KVStreamsError
from kvstreams.loop import train
from kvstreams.train.checkpoint import CHECKSUMS, checkpoint_problem
from kvstreams.train.config import load_config
from test_reliability import _copy, _flip_byte, _rows
from test_train import small_config

# --- kvstreams sft never overwrites a model it was not asked to ------------------------------------------


def _sft_config(base, out, *more):
    return load_config(
        None, [f'sft.base="{base}"', f'sft.out="{out}"', "sft.steps=2", "sft.episodes=2", *more]
    )


def test_sft_refuses_to_write_over_a_model_unless_forced(model_dirs, tmp_path):
    from kvstreams.train.sft import sft

    other = _copy(model_dirs["llama"], tmp_path / "other")
    before = sha256(other / "model.safetensors")
    with pytest.raises(KVStreamsError, match=r"already holds a model.*--force"):
        sft(_sft_config(model_dirs["qwen3"], other), show_progress=False)
    assert sha256(other / "model.safetensors") == before  # untouched
    sft(_sft_config(model_dirs["qwen3"], other), show_progress=False, force=True)
    assert json.loads((other / "config.json").read_text())["model_type"] == "qwen3"


def test_sft_refuses_to_replace_its_own_base_even_when_forced(model_dirs, tmp_path):
    from kvstreams.train.sft import sft

    base = _copy(model_dirs["qwen3"], tmp_path / "base")
    before = sha256(base / "model.safetensors")
    for force in (False, True):
        with pytest.raises(KVStreamsError, match=r"sft\.out is sft\.base"):
            sft(_sft_config(base, tmp_path / "base" / "."), show_progress=False, force=force)
    assert sha256(base / "model.safetensors") == before


def test_the_cli_passes_force_to_sft(model_dirs, tmp_path, capsys):
    from kvstreams import cli

    out = _copy(model_dirs["llama"], tmp_path / "out")
    argv = ["sft", "--set", f'sft.base="{model_dirs["qwen3"]}"', "--set", f'sft.out="{out}"']
    argv += ["--set", "sft.steps=1", "--set", "sft.episodes=2"]
    assert cli.main(argv) == 2 and "--force" in capsys.readouterr().err
    assert cli.main([*argv, "--force"]) == 0


# --- checkpoint pruning touches only this run's readable checkpoints -------------------------------------


def test_pruning_keeps_the_checkpoint_just_written_whatever_else_is_in_the_directory(
    two_steps, model_dirs, tmp_path
):
    root = _copy(two_steps, tmp_path / "r")
    ckpts = root / "run" / "checkpoints"
    (ckpts / "step-000100").mkdir()  # an empty directory sorting after every real checkpoint
    (ckpts / "step-zzz").mkdir()
    (ckpts / "step-zzz" / "notes.txt").write_text("not a checkpoint")
    cfg = small_config(
        model_dirs["qwen3"], root, **{"train.eval_every": "0", "train.steps": "3", "train.keep_last": "1"}
    )
    train(cfg, resume=True, show_progress=False)
    assert checkpoint_problem(ckpts / "step-000002") is None  # the one just written (0-based) survives
    assert not (ckpts / "step-000001").exists() and not (ckpts / "step-000000").exists()  # pruned
    assert (ckpts / "step-zzz" / "notes.txt").is_file() and (ckpts / "step-000100").is_dir()  # not ours
    more = small_config(
        model_dirs["qwen3"], root, **{"train.eval_every": "0", "train.steps": "4", "train.keep_last": "1"}
    )
    train(more, resume=True, show_progress=False)  # and it resumes from it
    assert [r["step"] for r in _rows(root / "run")] == [1, 2, 3, 4]


# --- a checkpoint is trusted only when every file is covered by its digests -----------------------------


CHECKSUM_EDITS = {
    "checksums.json deleted": lambda c: (c / CHECKSUMS).unlink(),
    "checksums.json empty object": lambda c: (c / CHECKSUMS).write_text("{}"),
    "checksums.json lists only state.json": lambda c: (c / CHECKSUMS).write_text(
        json.dumps({"state.json": sha256(c / "state.json")})
    ),
    "checksums.json a list": lambda c: (c / CHECKSUMS).write_text("[]"),
    "checksums.json maps to numbers": lambda c: (c / CHECKSUMS).write_text(json.dumps({"state.json": 1})),
}


@pytest.mark.parametrize("edit", list(CHECKSUM_EDITS))
def test_a_bit_flip_is_caught_whatever_checksums_json_says(edit, two_steps, model_dirs, tmp_path, capsys):
    root = _copy(two_steps, tmp_path / "r")
    newest = root / "run" / "checkpoints" / "step-000001"
    _flip_byte(newest / "model.safetensors")
    CHECKSUM_EDITS[edit](newest)
    assert checkpoint_problem(newest) is not None
    cfg = small_config(model_dirs["qwen3"], root, **{"train.eval_every": "0", "train.steps": "3"})
    train(cfg, resume=True, show_progress=False)
    err = capsys.readouterr().err
    assert "passed over checkpoint step-000001" in err and "resuming from step-000000" in err


def _rewrite_weights(checkpoint, edit) -> None:
    """Change the checkpoint's weights and write matching digests: only a content check can tell."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(checkpoint / "model.safetensors"))
    sums = json.loads((checkpoint / CHECKSUMS).read_text())
    sums["model.safetensors"] = sha256(checkpoint / "model.safetensors")
    (checkpoint / CHECKSUMS).write_text(json.dumps(sums))


def test_a_checkpoint_with_nan_weights_and_valid_digests_is_passed_over(
    two_steps, model_dirs, tmp_path, capsys
):
    root = _copy(two_steps, tmp_path / "r")
    newest = root / "run" / "checkpoints" / "step-000001"
    _rewrite_weights(newest, lambda t: next(iter(t.values())).view(-1)[0].fill_(float("nan")))
    assert checkpoint_problem(newest) is None  # the digests match: only loading can tell
    cfg = small_config(model_dirs["qwen3"], root, **{"train.eval_every": "0", "train.steps": "3"})
    train(cfg, resume=True, show_progress=False)
    err = capsys.readouterr().err
    assert "passed over checkpoint step-000001" in err and "non-finite" in err
    assert [r["step"] for r in _rows(root / "run")] == [1, 2, 3]


# --- a model directory loads completely or not at all ----------------------------------------------------


def _drop_tensor(d) -> str:
    tensors = load_file(str(d / "model.safetensors"))
    name = next(k for k in tensors if "layers.1." in k and k.endswith("q_proj.weight"))
    del tensors[name]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return name


def _add_tensor(d) -> str:
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return "extra.weight"


def _nan_tensor(d) -> str:
    tensors = load_file(str(d / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("down_proj.weight"))
    tensors[name].view(-1)[3] = float("inf")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize(
    ("edit", "message"),
    [(_drop_tensor, "missing"), (_add_tensor, "unexpected"), (_nan_tensor, "non-finite")],
)
def test_a_model_whose_weights_do_not_match_is_refused_at_load(edit, message, model_dirs, tmp_path):
    from kvstreams.models import load_model

    d = _copy(model_dirs["qwen3"], tmp_path / "m")
    name = edit(d)
    with pytest.raises(KVStreamsError, match=message) as err:
        load_model(d)
    assert name in str(err.value) and "\n" not in str(err.value)


# --- settings that would give a wrong result are refused when the config loads ---------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (['train.out_dir=""'], "train.out_dir"),
        (["train.eval_seed=0"], "overlap the held-out ones"),
        (["train.seed=1000"], "overlap the held-out ones"),  # seed * 1000 reaches eval_seed
        (["optim.lr=1e300"], "optim.lr"),
        ([f"train.seed={2**63 - 1}"], "train.seed"),
        (["train.eval_seed=-5"], "train.eval_seed"),
    ],
)
def test_settings_that_would_mislead_are_a_config_error(sets, message):
    with pytest.raises(KVStreamsError, match=message):
        load_config(None, sets)


def test_allow_config_change_without_resume_is_refused(capsys):
    from kvstreams import cli

    assert cli.main(["train", "--allow-config-change", "--set", "train.steps=1"]) == 2
    assert "applies to --resume only" in capsys.readouterr().err


# --- hangs and late errors: what can be checked before compute is ----------------------------------------


def _small_positions(model_dirs, tmp_path, n: int = 256):
    d = _copy(model_dirs["qwen3"], tmp_path / "short")
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = n
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize(
    "argv", [["--max-new-tokens", "40000"], ["--prompt-len", "40000"]], ids=["new tokens", "prompt"]
)
def test_verify_refuses_sequences_beyond_the_models_positions_before_sampling(argv, model_dirs, capsys):
    import time

    from kvstreams import cli

    start = time.perf_counter()
    assert cli.main(["verify", "--model", model_dirs["qwen3"], "--policy", "snapkv", *argv]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    assert time.perf_counter() - start < 30  # refused up front (it used to sample for minutes)


def test_verify_refuses_a_json_path_that_is_a_directory_before_any_work(model_dirs, tmp_path, capsys):
    from kvstreams import cli

    argv = ["verify", "--model", str(tmp_path / "no-model"), "--json", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "is a directory" in capsys.readouterr().err  # before the (missing) model is even looked at


def test_train_refuses_a_reply_limit_beyond_the_models_positions(model_dirs, tmp_path):
    short = _small_positions(model_dirs, tmp_path)
    cfg = small_config(str(short), tmp_path, **{"rollout.max_reply_tokens": "300"})
    with pytest.raises(KVStreamsError, match=r"rollout.max_reply_tokens = 300 reaches"):
        train(cfg, show_progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was sampled

"""Checkpoints: model and optimizer as safetensors (no pickle), RNG states, step and config as JSON.

Each checkpoint is a directory ``step-000012/`` written as a temporary directory and renamed into
place, so a process killed at any moment leaves either the previous checkpoints or a complete new
one, never a corrupt one. The last ``keep_last`` are kept. Every file's sha256 is written with it
(``checksums.json``); resuming skips a checkpoint that fails its digests or does not load, saying
so, and falls back to the previous one.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from kvstreams.atomic import sha256
from kvstreams.errors import KVStreamsError
from kvstreams.models import first_nonfinite

if TYPE_CHECKING:
    from kvstreams.train.config import Config

PREFIX = "step-"
CHECKSUMS = "checksums.json"
FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")  # all digested
_NAME = re.compile(rf"{PREFIX}\d{{6}}")


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for index, values in meta["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    model,
    optimizer,
    scheduler,
    config: dict[str, Any],
    keep_last: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / f"{PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=out))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        opt_tensors, opt_meta = _flatten_optimizer(optimizer)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
        state = {
            "step": step,
            "optimizer": opt_meta,
            "scheduler": scheduler.state_dict(),
            "python_random": random.getstate()[1],
            "config": config,
            **(extra or {}),
        }
        (tmp / "state.json").write_text(json.dumps(state, default=_jsonable))
        # written last: a checkpoint whose files do not match these digests is not loaded
        (tmp / CHECKSUMS).write_text(json.dumps({f.name: sha256(f) for f in sorted(tmp.iterdir())}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(out, final, keep_last)
    return final


def _prune(out: Path, newest: Path, keep_last: int) -> None:
    """Delete this run's checkpoints older than the ``keep_last`` newest (``newest``, just written,
    always among them). Anything else named ``step-*`` (an empty directory, a file, a directory
    without digests) is not ours to delete and must not count towards ``keep_last``. A checkpoint is
    recognised by its layout, not by re-hashing it: pruning runs at every save."""
    older = sorted(p for p in out.iterdir() if p.name < newest.name and _is_checkpoint(p))
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _is_checkpoint(path: Path) -> bool:
    """A directory written by :func:`save_checkpoint`: ``step-NNNNNN`` with digests and a state.json
    whose step is the name's."""
    if not (_NAME.fullmatch(path.name) and (path / CHECKSUMS).is_file()):
        return False
    try:
        return json.loads((path / "state.json").read_text())["step"] == int(path.name[len(PREFIX) :])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(type(value))


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = sorted(p for p in Path(out_dir).glob(f"{PREFIX}*") if (p / "state.json").is_file())
    return found[-1] if found else None


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be trusted, or None. Checks the digests written
    with it (a bit flip or a truncated file) -- every file of a checkpoint must be covered, so a
    deleted, emptied or edited ``checksums.json`` is a problem too -- then ``state.json``'s step
    against the directory name. Finite weights are checked when it loads (:func:`load_checkpoint`)."""
    if not path.is_dir():
        return "not a directory"
    try:
        expected = json.loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        return f"no {CHECKSUMS} (a checkpoint without digests is not trusted)"
    except (OSError, ValueError):
        return f"{CHECKSUMS} is unreadable"
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        return f"{CHECKSUMS} is not a map of file names to digests"
    uncovered = [name for name in FILES if name not in expected]
    if uncovered:
        return f"{CHECKSUMS} does not cover {', '.join(uncovered)}"
    for name, digest in expected.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if sha256(f) != digest:
            return f"{name} does not match its checksum"
    try:
        step = json.loads((path / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return "state.json is unreadable or has no step"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"state.json holds an invalid step {step!r}"
    if path.name != f"{PREFIX}{step:06d}":
        return f"state.json says step {step}, the directory another"
    return None


def resume_latest(out_dir: str | Path, model, optimizer, scheduler) -> tuple[Path, dict[str, Any], list[str]]:
    """Load the newest checkpoint that checks out and loads, newest first; returns it, its state and
    one line per newer checkpoint that was passed over (and why)."""
    candidates = sorted((p for p in Path(out_dir).glob(f"{PREFIX}*")), reverse=True)
    skipped: list[str] = []
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            try:
                return path, load_checkpoint(path, model, optimizer, scheduler), skipped
            except KVStreamsError as err:
                problem = str(err).removeprefix(f"cannot resume from {path}: ")
        skipped.append(f"{path.name}: {problem}")
    detail = f" ({'; '.join(skipped)})" if skipped else ""
    raise KVStreamsError(f"nothing to resume: no readable checkpoint under {out_dir}{detail}")


def remove_orphans(out_dir: str | Path) -> list[Path]:
    """Delete temporary checkpoint directories a killed process left behind (``.step-*``)."""
    orphans = [p for p in Path(out_dir).glob(f".{PREFIX}*") if p.is_dir()]
    for p in orphans:
        shutil.rmtree(p, ignore_errors=True)
    return orphans


def load_checkpoint(path: str | Path, model, optimizer, scheduler) -> dict[str, Any]:
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
        load_model(model, str(path / "model.safetensors"), strict=True)
        bad = first_nonfinite(model)
        if bad is not None:
            raise ValueError(f"non-finite weights in {bad}")
        optimizer.load_state_dict(
            _unflatten_optimizer(load_file(str(path / "optimizer.safetensors")), state["optimizer"])
        )
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(load_file(str(path / "rng.safetensors"))["torch_cpu"])
        random.setstate((3, tuple(state["python_random"]), None))
    except (OSError, KeyError, ValueError, RuntimeError, TypeError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise KVStreamsError(f"cannot resume from {path}: {type(err).__name__}: {first}") from None
    return state


# --- resuming under a changed config ------------------------------------------------------------------
# Settings a resumed run may change freely: they alter what is logged and kept, not what is optimised.
FREE_TO_CHANGE = (
    "train.steps",
    "train.eval_every",
    "train.eval_episodes",
    "train.eval_samples",
    "train.checkpoint_every",
    "train.keep_last",
    "train.max_nonfinite_steps",
    "train.tensorboard",
    "train.plots",
    "train.out_dir",
    "model.device",
    "sft.",
    "cluster.",  # where the work runs, not what is optimised: resume with another layout
)


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """Dotted keys whose value differs between two config dumps, except :data:`FREE_TO_CHANGE`
    (``train.steps`` only under a constant schedule: it stretches a linear or cosine one)."""
    a, b = _flatten(_renamed(old)), _flatten(_renamed(new))
    free = FREE_TO_CHANGE
    if b.get("optim.schedule", "constant") != "constant":
        free = tuple(k for k in FREE_TO_CHANGE if k != "train.steps")
    return {
        k: [a.get(k), b.get(k)]
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not k.startswith(free)
    }


def _renamed(dump: dict[str, Any]) -> dict[str, Any]:
    """A config dump under today's names (a run checkpointed before a rename resumes as unchanged)."""
    from kvstreams.compaction.base import renamed_options

    rollout = dump.get("rollout")
    if not isinstance(rollout, dict) or not isinstance(rollout.get("strategy_args"), dict):
        return dump
    return {**dump, "rollout": {**rollout, "strategy_args": renamed_options(rollout["strategy_args"])}}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("env_args", "strategy_args", "policy_args"):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_drift(old: dict[str, Any], cfg: Config, out: Path, start: int, allowed: bool) -> None:
    """Refuse to resume under a config that changes the optimisation, unless allowed (then recorded)."""
    changes = config_changes(old, cfg.model_dump())
    if not changes:
        return
    listed = ", ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changes.items())
    if not allowed:
        raise KVStreamsError(
            f"the config differs from the one {out} was trained with ({listed}); "
            "pass --allow-config-change to resume under the new one (the change is recorded)"
        )
    with (out / "config_changes.jsonl").open("a") as f:
        f.write(json.dumps({"step": start, "changes": changes}) + "\n")
    print(f"kvstreams train: resuming at step {start} under a changed config ({listed})", file=sys.stderr)


def prepare_run(out: Path, resume: bool) -> None:
    """Before the model loads: remove checkpoints a killed run left unfinished (said on stderr), and
    refuse to start afresh over a run already there."""
    checkpoints = out / "checkpoints"
    for orphan in remove_orphans(checkpoints):
        print(
            f"kvstreams train: removed {orphan.name}, a checkpoint a killed run left unfinished",
            file=sys.stderr,
        )
    if not resume and latest_checkpoint(checkpoints) is not None:
        raise KVStreamsError(
            f"{out} already holds a run; pass --resume to continue it or choose another out_dir"
        )


def resume_run(out: Path, cfg: Config, model, optimizer, scheduler, allow_config_change: bool) -> int:
    """Restore the newest good checkpoint of the run in ``out`` into the model and optimiser (checkpoints
    passed over are said on stderr); refuse a finished run, or a changed optimisation unless allowed.
    Returns the first step to run."""
    path, state, skipped = resume_latest(out / "checkpoints", model, optimizer, scheduler)
    for line in skipped:
        print(f"kvstreams train: passed over checkpoint {line}; resuming from {path.name}", file=sys.stderr)
    start = int(state["step"]) + 1
    if start >= cfg.train.steps:
        raise KVStreamsError(
            f"{out} is finished ({start} of train.steps = {cfg.train.steps} steps done); "
            "raise train.steps to continue it"
        )
    check_drift(state.get("config", {}), cfg, out, start, allow_config_change)
    return start

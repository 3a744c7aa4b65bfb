"""Experiment specifications: ``configs/experiments/NAME.toml``.

An experiment is a set of *arms* (train configs that differ by a few keys) run over seeds. The file
holds a ``[base]`` train config (the schema of ``kvstreams train``), one ``[[arms]]`` table per arm
with its dotted overrides, how the starting model is made (``[warm_start]``: a seeded tiny model
plus SFT on the environment's expert, or a fixed ``model`` directory), optional held-out
``[[evals]]`` after training, and a ``[quick]`` table that shrinks everything for CI. Every arm's
config is validated when the file loads, so a typo is one line before any run starts.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvstreams.errors import KVStreamsError
from kvstreams.train.config import Config, set_dotted, validate_config


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Arm(_Table):
    name: str = Field(pattern=r"^[A-Za-z0-9_.+-]+$", description="directory name of the arm's runs")
    label: str = Field("", description="what tables and plots call it (default: name)")
    set: dict[str, Any] = Field(default_factory=dict, description="dotted overrides of [base]")
    groups: list[str] = Field(
        default_factory=lambda: ["main"],
        min_length=1,
        description="the tables (and plots) the arm appears in; groups run in the order they first appear",
    )


class WarmStart(_Table):
    """A tiny random model seeded with the run's seed, then SFT on the environment's expert (the
    ``[sft]`` section of the arm's config). Shared by all arms of a seed: arms are compared paired."""

    arch: str = "qwen3"
    layers: int = Field(4, ge=1)
    hidden: int = Field(128, ge=8)
    heads: int = Field(4, ge=1)
    env_args: dict[str, Any] | None = Field(
        None, description="environment options for the demonstrations (default: the rollout's)"
    )
    sft: bool = Field(True, description="false: the fresh random model itself (the bandit rung)")
    set: dict[str, Any] | None = Field(
        None,
        description="dotted overrides of [base] for the SFT and its validation, e.g. "
        '{ "rollout.mode" = "full" } to validate with full context (default: the first arm\'s config)',
    )


class Evaluation(_Table):
    """A held-out evaluation after training, with its own rollout overrides (e.g. a harder game)."""

    name: str
    set: dict[str, Any] = Field(default_factory=dict)
    episodes: int | None = Field(None, ge=1, description="default: train.eval_episodes")
    measure: str | None = Field(None, description="an extra measurement (experiments/measures.py)")


class Quick(_Table):
    """``--quick``: overrides that make the whole experiment finish in minutes (CI)."""

    seeds: int = Field(1, ge=1)
    arms: list[str] | None = Field(None, description="the arms to run (default: all)")
    set: dict[str, Any] = Field(default_factory=dict, description="dotted overrides of every arm")
    sft_steps: int | None = Field(None, ge=1)


class Check(_Table):
    """What every run of the experiment must reach: ``kvstreams experiment`` exits 1 when one does not,
    so an experiment with a check can guard CI (the RL sanity ladder). Figures are the run's evaluations
    before training and after its last step (``eval/...`` keys of ``metrics.jsonl``)."""

    metric: str = Field("eval/reward_mean", pattern=r"^eval/", description="the evaluation figure checked")
    final_at_least: float | None = Field(None, description="after training, metric >= this")
    gain_at_least: float | None = Field(None, description="after minus before >= this")
    in_quick: bool = Field(True, description="also checked under --quick (false: toy sizes cannot reach it)")

    @model_validator(mode="after")
    def _something(self) -> Check:
        if self.final_at_least is None and self.gain_at_least is None:
            raise ValueError("a check needs final_at_least or gain_at_least")
        return self

    def verdict(self, start: dict[str, float], final: dict[str, float]) -> dict[str, Any]:
        """One run's figures and whether they pass."""
        before, after = start.get(self.metric), final.get(self.metric)
        ok = after is not None
        if ok and self.final_at_least is not None:
            ok = after >= self.final_at_least
        if ok and self.gain_at_least is not None:
            ok = before is not None and after - before >= self.gain_at_least
        return {"metric": self.metric, "before": before, "after": after, "passed": ok}

    def describe(self) -> str:
        parts = []
        if self.final_at_least is not None:
            parts.append(f"{self.metric} after training >= {self.final_at_least:g}")
        if self.gain_at_least is not None:
            parts.append(f"{self.metric} gain >= {self.gain_at_least:+g}")
        return " and ".join(parts) + " on every run"


class Probe(_Table):
    """``kind = "is_variance"``: the importance-weight probe (no training)."""

    lengths: list[int] = Field(default_factory=lambda: [16, 32, 64, 128])
    episodes: int = Field(32, ge=2)
    real_model: bool = Field(True, description="also SmolLM2-135M when it has been converted")


class ExperimentSpec(_Table):
    name: str
    title: str
    source: str = Field(description="the paper result it reproduces, cited")
    question: str = Field(description="what the experiment answers")
    kind: Literal["train", "evaluate", "is_variance", "ladder"] = Field(
        "train",
        description="train: RL per arm x seed; evaluate: the starting model of each seed in each arm's "
        "setting, no training (what a rollout feature buys at fixed weights); is_variance: a probe; "
        "ladder: rungs that are experiments of their own",
    )
    rungs: list[str] = Field(
        default_factory=list, description="kind = 'ladder': the experiments run in order, each with its check"
    )
    check: Check | None = None
    seeds: int = Field(3, ge=1)
    model: str | None = Field(
        None,
        description="an existing model directory for every run, or a converted pretrained model's name (smollm2)",
    )
    warm_start: WarmStart | None = None
    base: dict[str, Any] = Field(default_factory=dict)
    arms: list[Arm] = Field(default_factory=list)
    evals: list[Evaluation] = Field(default_factory=list)
    quick: Quick = Field(default_factory=Quick)
    target_reward: float | None = Field(
        None, description="eval reward whose first crossing gives time-to-target (compaction-speed)"
    )
    reference_arm: str | None = Field(None, description="the arm others are compared with, per seed")
    probe: Probe = Field(default_factory=Probe)
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="dotted overrides of every arm, applied last (--set, --device)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSpec:
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names repeat: {names}")
        if self.kind == "ladder" and (not self.rungs or self.arms):
            raise ValueError("a ladder names its rungs (other experiments) and has no arms of its own")
        if self.kind in ("train", "evaluate") and not self.arms:
            raise ValueError(f"a {self.kind} experiment needs at least one [[arms]]")
        if self.kind in ("train", "evaluate") and (self.model is None) == (self.warm_start is None):
            raise ValueError("give exactly one of model (a directory) and [warm_start]")
        if self.kind == "evaluate" and (self.evals or self.target_reward is not None or self.check):
            raise ValueError("an evaluate experiment trains nothing: its arms are the evaluations")
        if self.reference_arm is not None and self.reference_arm not in names:
            raise ValueError(f"reference_arm {self.reference_arm!r} is not an arm")
        from kvstreams.experiments.measures import MEASURES

        for e in self.evals:
            if e.measure is not None and e.measure not in MEASURES:
                raise ValueError(
                    f"evals {e.name!r}: unknown measure {e.measure!r}; one of {sorted(MEASURES)}"
                )
        unknown = set(self.quick.arms or []) - set(names)
        if unknown:
            raise ValueError(f"quick.arms names unknown arms: {sorted(unknown)}")
        return self

    def arms_to_run(self, quick: bool) -> list[Arm]:
        if quick and self.quick.arms:
            return [a for a in self.arms if a.name in self.quick.arms]
        return list(self.arms)

    def warm_start_arm(self) -> Arm:
        """Whose config the warm start's SFT (and its validation) runs with: ``[warm_start] set`` over
        ``[base]`` when given, else the first arm's."""
        ws = self.warm_start
        if ws is not None and ws.set is not None:
            return Arm(name="warm-start", set=ws.set)
        return self.arms[0]

    def groups(self, arms: list[Arm]) -> list[str]:
        return list(dict.fromkeys(g for a in arms for g in a.groups))

    def arm_config(self, arm: Arm, seed: int, model: str, out_dir: Path, quick: bool) -> Config:
        """The train config of one run: base, then the arm's overrides, then --quick's, then what the
        runner owns (model, seed, output directory)."""
        data = copy.deepcopy(self.base)
        for key, value in arm.set.items():
            set_dotted(data, key, copy.deepcopy(value))
        if quick:
            for key, value in self.quick.set.items():
                set_dotted(data, key, copy.deepcopy(value))
        for key, value in self.overrides.items():
            set_dotted(data, key, copy.deepcopy(value))
        set_dotted(data, "model.path", model)
        set_dotted(data, "train.seed", seed)
        set_dotted(data, "train.out_dir", str(out_dir))
        set_dotted(data, "train.tensorboard", False)
        try:
            return validate_config(data)
        except KVStreamsError as err:
            raise KVStreamsError(f"experiment {self.name!r}, arm {arm.name!r}: {err}") from None


EXPERIMENTS_DIR = "configs/experiments"


def experiments_dir() -> Path:
    """``configs/experiments`` of the working directory, else of the source checkout."""
    here = Path.cwd() / EXPERIMENTS_DIR
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[3] / EXPERIMENTS_DIR


def available() -> list[str]:
    d = experiments_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def load_spec(name_or_path: str, overrides: dict[str, Any] | None = None) -> ExperimentSpec:
    """An experiment by name (``configs/experiments/NAME.toml``) or by path, with ``overrides`` of
    every arm; every arm's config is validated here (with a placeholder model path: the runner
    supplies the real one)."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" and path.is_file()):
        path = experiments_dir() / f"{name_or_path}.toml"
        if not path.is_file():
            raise KVStreamsError(
                f"unknown experiment {name_or_path!r}; choose one of {', '.join(available()) or '(none found)'}"
            )
    try:
        data = tomllib.loads(path.read_text())
        if overrides:
            data["overrides"] = {**data.get("overrides", {}), **overrides}
        spec = ExperimentSpec.model_validate(data)
    except tomllib.TOMLDecodeError as err:
        raise KVStreamsError(f"{path}: invalid TOML: {err}") from None
    except UnicodeDecodeError:
        raise KVStreamsError(f"{path}: not UTF-8 text (TOML files are UTF-8)") from None
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise KVStreamsError(f"{path}: {where}: {first['msg'].removeprefix('Value error, ')}") from None
    for arm in spec.arms:
        for quick in (False, True):
            spec.arm_config(arm, 0, spec.model or "(warm start)", Path("(run)"), quick)
    return spec

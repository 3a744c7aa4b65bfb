"""Training configuration: TOML files validated by pydantic.

Unknown keys, wrong types and impossible combinations are one clear error before any work starts.
``kvstreams config show --config FILE [--set key=value]`` prints the resolved configuration.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvstreams.envs import is_single_turn
from kvstreams.errors import KVStreamsError
from kvstreams.train.corrections import (
    BehaviourRatioLoss,
    NaiveLoss,
    RePrefillLoss,
    ShadowLoss,
    SparseRLLoss,
    SparseRLReleasedLoss,
    TISLoss,
)


class _Section(BaseModel):
    # strict: `steps = true` is not 1; allow_inf_nan: no nan or inf reaches the optimiser or the sampler
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class ModelSection(_Section):
    path: str = "runs/demo/models/tiny-qwen3-sft"
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    reference: str | None = None  # frozen reference for the KL term; default: the starting weights

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        import torch

        try:
            torch.device(value)
        except RuntimeError:
            raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:1, mps, ...)") from None
        return value


class CurriculumStage(_Section):
    """``[[rollout.curriculum]]``: an easier task for the first training steps. Stages run in order
    from step 0, each for its ``steps``; then the rollout settings themselves (the target task), which
    every evaluation uses from the start. Only the task changes: the mode, the policy and the learner
    stay as configured."""

    steps: int = Field(ge=1, description="training steps this stage lasts")
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="merged over rollout.env_args for this stage (e.g. fewer turns)"
    )
    strategy_args: dict[str, Any] = Field(
        default_factory=dict,
        description="merged over rollout.strategy_args (e.g. a smaller token_budget, so that a short "
        "episode still compacts)",
    )

    @field_validator("strategy_args")
    @classmethod
    def _token_budget(cls, args: dict[str, Any]) -> dict[str, Any]:
        return RolloutSection._token_budget(args)


class RolloutSection(_Section):
    env: str = "memory"
    env_args: dict[str, Any] = Field(default_factory=dict)
    strategy: str | None = "markovian"  # compaction for multi-turn environments
    strategy_preset: str | None = None  # e.g. "kvstreams": the KV-streams authors' settings
    strategy_args: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["stream", "reprefill", "full"] = "stream"
    policy: str | None = None  # KV compression while sampling; in multi-turn episodes it runs inside them,
    # with or without a compaction strategy (kvstreams.engine.compression)
    policy_args: dict[str, Any] = Field(default_factory=dict)
    recall: str | None = None  # bring deleted units back when an observation asks for them ("lexical";
    # kvstreams.compaction.recall); recall_args.how: "archive" (stream: the K/V put back) or "recompute"
    recall_args: dict[str, Any] = Field(default_factory=dict)
    prompts_per_step: int = Field(2, ge=1)
    group_size: int = Field(8, ge=2, description="K rollouts per prompt (GRPO group)")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_reply_tokens: int = Field(48, ge=1)
    max_new_tokens: int = Field(256, ge=1, description="single-turn environments")
    block_size: int = Field(1, ge=1)
    curriculum: list[CurriculumStage] = Field(
        default_factory=list, description="easier tasks first (CurriculumStage); evaluation: the target"
    )

    def stage_of(self, step: int) -> int:
        """The curriculum stage training step ``step`` is in (``len(curriculum)``: the target task)."""
        end = 0
        for i, stage in enumerate(self.curriculum):
            end += stage.steps
            if step < end:
                return i
        return len(self.curriculum)

    def at_step(self, step: int | None) -> RolloutSection:
        """The settings training step ``step`` samples with: its curriculum stage's task, or these
        (``None``: an evaluation, always the target task)."""
        if step is None or (i := self.stage_of(step)) == len(self.curriculum):
            return self
        stage = self.curriculum[i]
        return self.model_copy(
            update={
                "env_args": {**self.env_args, **stage.env_args},
                "strategy_args": {**self.strategy_args, **stage.strategy_args},
                "curriculum": [],
            }
        )

    @field_validator("strategy_args")
    @classmethod
    def _token_budget(cls, args: dict[str, Any]) -> dict[str, Any]:
        """B is ``token_budget``; ``budget`` (its name before "budget" meant a policy's only) is read as
        it, with a warning."""
        from kvstreams.compaction.base import renamed_options

        return renamed_options(args, warn=True)


LossSection = Annotated[
    ShadowLoss
    | NaiveLoss
    | BehaviourRatioLoss
    | TISLoss
    | SparseRLLoss
    | SparseRLReleasedLoss
    | RePrefillLoss,
    Field(discriminator="type"),
]
"""``[loss]``: ``type`` picks the rollout correction (``kvstreams.train.corrections``), whose own fields
follow; the PPO/GRPO fields are shared (``LossBase``)."""


class OptimSection(_Section):
    lr: float = Field(2e-4, gt=0, le=1e6)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    updates_per_batch: int = Field(1, ge=1, description="optimizer steps on each batch against pi_old")
    micro_batch_tokens: int = Field(8192, ge=64)
    packed: bool | None = Field(
        None,
        description="pack a micro-batch's traces in one row (no padding) or pad one trace per row; "
        "default: packed, except with train.backend = 'sdpa', whose dense mask is quadratic in the row length",
    )


class TrainSection(_Section):
    steps: int = Field(20, ge=1)
    seed: int = Field(0, ge=0, lt=2**31, description="the run's seed (environment and sampling seeds follow)")
    out_dir: str = Field("runs/train", min_length=1, description="the run directory ('' is refused)")
    eval_every: int = Field(10, ge=0)
    eval_episodes: int = Field(16, ge=1, description="held-out tasks per evaluation")
    eval_samples: int = Field(
        1,
        ge=1,
        description="sampled episodes per held-out task: pass@1 is estimated from all of them and "
        "pass@k is reported for k = eval_samples (train/evaluation.py); plus one greedy episode per task",
    )
    eval_seed: int = Field(
        1_000_000,
        ge=0,
        lt=2**31,
        description="held-out seeds start here; the run's training seeds may not reach them (checked)",
    )
    checkpoint_every: int = Field(1, ge=1, description="1: a crash loses at most the step in flight")
    keep_last: int = Field(2, ge=1)
    asynchronous: bool = False
    max_async_level: int = Field(
        1,
        ge=0,
        description="asynchronous mode: the rollouts of step s start only once the weights of step "
        "s - max_async_level are published (prime-rl's max_async_level; 0 waits for the newest)",
    )
    max_off_policy_steps: int = Field(
        3,
        ge=0,
        description="a group whose oldest sampled token came from weights more than this many steps "
        "older than the step that trains it is dropped, not trained on (prime-rl; KV-streams used 3)",
    )
    zero_variance_groups: Literal["keep", "drop"] = Field(
        "keep",
        description="GRPO groups whose rewards are all equal have zero advantage: keep them in the "
        "batch (they still count in the token normaliser and the KL term) or drop them before the "
        "update (DAPO's dynamic sampling, filtering without resampling); the share is logged as "
        "rollout/zero_variance_group_frac. Measured: docs/results.md (rl-sanity)",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="a step whose loss or gradient is not finite is skipped (counted as "
        "optim/nonfinite_skipped); this many in a row stop the run",
    )
    backend: Literal["auto", "sdpa", "flex", "blocksparse"] = Field(
        "auto",
        description="the learner's masked attention: sdpa (dense T x T mask, the reference), flex "
        "(flex_attention BlockMask; GPU only for training), blocksparse (visible key blocks only, "
        "recomputing backward; memory linear in T on CPU too); auto: flex on CUDA, blocksparse elsewhere",
    )
    term_grad_norms: bool = Field(
        False,
        description="log each loss term's gradient norm before clipping (grad/pg_norm, grad/distill_norm, "
        "grad/kl_norm, grad/entropy_norm; mean over the batch's updates) by backpropagating the terms "
        "one at a time: which term moves the weights (SMD's distillation against the policy gradient). "
        "Costs a backward per term; the update applied is their sum (the one backward's gradient up to "
        "float rounding); one learner process only",
    )
    tensorboard: bool = True
    plots: bool = True


class SFTSection(_Section):
    base: str = "runs/demo/models/tiny-qwen3"
    out: str = "runs/demo/models/tiny-qwen3-sft"
    episodes: int = Field(64, ge=1)
    steps: int = Field(200, ge=1)
    batch_size: int = Field(8, ge=1)
    lr: float = Field(3e-3, gt=0)
    seed: int = 0
    stop_at_reward: float | None = Field(
        None,
        ge=0,
        le=1,
        description="stop once the mean sampled reward on held-out validation tasks reaches this: a "
        "warm start weak on purpose, at the same level on every seed (the sanity ladder's rung 2). "
        "The validation tasks are not the evaluation's (seeds from train.eval_seed + 500000)",
    )
    check_every: int = Field(10, ge=1, description="with stop_at_reward: SFT steps between validations")
    check_episodes: int = Field(
        64, ge=1, description="with stop_at_reward: validation tasks, one sample each"
    )


class ClusterSection(_Section):
    """``[cluster]``: where rollouts and the learner run (docs/scale-out.md). The defaults are the
    embedded single-process path; anything else needs Ray (``pip install 'kvstreams[cluster]'``)."""

    rollout_workers: int = Field(
        0,
        ge=0,
        description="Ray actors, each an engine replica with its own environments; a batch's episodes "
        "are split between them by GRPO group. 0: rollouts run in the trainer's process",
    )
    learner_world_size: int = Field(
        1,
        ge=1,
        description="FSDP2 ranks of the learner (Ray actors in one torch.distributed group: gloo on "
        "CPU, NCCL on CUDA); 1: the learner runs in the trainer's process",
    )
    address: str = Field(
        "",
        description="an existing Ray cluster to join ('auto', or host:port of `ray start --head`); "
        "empty: start Ray on this machine",
    )
    worker_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each rollout worker")
    worker_gpus: float = Field(0.0, ge=0, description="GPUs for each rollout worker (fractions share one)")
    learner_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each learner rank")
    learner_gpus: float = Field(0.0, ge=0, description="GPUs for each learner rank (1 on a GPU cluster)")
    max_worker_restarts: int = Field(
        3,
        ge=0,
        description="a rollout worker that dies is started again and its episodes rerun, at most this "
        "many times in a run; after that its episodes are dropped and counted",
    )

    @property
    def distributed(self) -> bool:
        return self.rollout_workers > 0 or self.learner_world_size > 1


class Config(_Section):
    model: ModelSection = Field(default_factory=ModelSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    loss: LossSection = Field(default_factory=ShadowLoss)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_type(cls, value: Any) -> Any:
        if isinstance(value, dict) and "type" not in value:
            if "correction" in value:
                raise ValueError('correction is now type (e.g. type = "shadow")')
            value = {**value, "type": "shadow"}
        return value

    @model_validator(mode="after")
    def _resolve_defaults(self) -> Config:
        """The settings that follow from others, resolved once so config.json states what runs."""
        if self.train.backend == "auto":
            self.train.backend = "flex" if self.model.device.startswith("cuda") else "blocksparse"
        if self.optim.packed is None:
            self.optim.packed = self.train.backend != "sdpa"
        return self

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        r, loss = self.rollout, self.loss
        if loss.type == "reprefill" and r.mode != "reprefill":
            raise ValueError(
                "loss.type = 'reprefill' trains re-prefill segments: set rollout.mode = 'reprefill'"
            )
        if r.mode == "reprefill" and loss.type != "reprefill":
            raise ValueError("rollout.mode = 'reprefill' gives segments: set loss.type = 'reprefill'")
        if self.train.backend == "flex" and self.model.device == "cpu":
            raise ValueError(
                "train.backend = 'flex' needs a GPU: torch's flex_attention has no backward on CPU "
                "(use 'sdpa' or 'blocksparse' on CPU; `kvstreams verify --backend flex` checks the forward there)"
            )
        check_rollout(r)
        _check_curriculum(self)
        if self.train.asynchronous and r.mode == "reprefill":
            raise ValueError("asynchronous training is implemented for stream and full modes")
        _check_cluster(self)
        _check_seed_streams(self)
        return self


def _check_curriculum(cfg: Config) -> None:
    """Every stage's task builds, and the stages leave training steps for the target task."""
    stages = cfg.rollout.curriculum
    if not stages:
        return
    if sum(s.steps for s in stages) >= cfg.train.steps:
        raise ValueError(
            f"rollout.curriculum: its stages last {sum(s.steps for s in stages)} steps of the run's "
            f"{cfg.train.steps}: none would be left for the target task (train.steps)"
        )
    if cfg.rollout.strategy is None and any(s.strategy_args for s in stages):
        raise ValueError("rollout.curriculum: a stage sets strategy_args but rollout.strategy is none")
    start = 0
    for i, stage in enumerate(stages):
        try:
            _check_builds(cfg.rollout.at_step(start))
        except ValueError as err:
            raise ValueError(f"rollout.curriculum[{i}]: {err}") from None
        start += stage.steps


def _check_seed_streams(cfg: Config) -> None:
    """Training and evaluation draw disjoint tasks: the run's training environment seeds
    (``train.seed * 1000 + step * prompts_per_step + p``, :func:`kvstreams.train.rollouts.training_plan`)
    must stay below ``train.eval_seed`` or start after its last held-out task."""
    t = cfg.train
    first = t.seed * 1_000
    last = first + t.steps * cfg.rollout.prompts_per_step - 1
    eval_last = t.eval_seed + t.eval_episodes - 1
    if first <= eval_last and t.eval_seed <= last:
        raise ValueError(
            f"train: the training tasks (seeds {first}..{last}) overlap the held-out ones (train.eval_seed "
            f"= {t.eval_seed}..{eval_last}): evaluation would score tasks the run trained on; move "
            "train.eval_seed above the training seeds or lower train.seed"
        )


def _check_cluster(cfg: Config) -> None:
    """A distributed run needs Ray, and GPUs on the ranks when the model is on CUDA: said before any
    process starts."""
    c = cfg.cluster
    if cfg.train.term_grad_norms and c.learner_world_size > 1:
        raise ValueError(
            "train.term_grad_norms is measured in one learner process: set learner_world_size = 1"
        )
    if not c.distributed:
        return
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "rollout_workers > 0 or learner_world_size > 1 needs Ray: pip install 'kvstreams[cluster]'"
        )
    on_gpu = cfg.model.device.startswith("cuda")
    if on_gpu and c.learner_world_size > 1 and c.learner_gpus < 1:
        raise ValueError("model.device is CUDA: set cluster.learner_gpus = 1 (one GPU per FSDP2 rank)")
    if on_gpu and c.rollout_workers and c.worker_gpus == 0:
        raise ValueError("model.device is CUDA: give rollout workers a GPU share (cluster.worker_gpus)")


def check_rollout(r: RolloutSection) -> None:
    """The rules of what may be sampled together, in one place (training configs and ``kvstreams
    rollout`` both ask here): a compacting mode needs a strategy, and everything named builds."""
    if r.mode != "full" and not is_single_turn(r.env) and not r.strategy:
        raise ValueError(
            f"rollout.mode = {r.mode!r} needs a compaction strategy (rollout.strategy, --strategy)"
        )
    _check_builds(r)


def _check_builds(r: RolloutSection) -> None:
    """The environment, strategy and policy the rollouts will build, built now: bad names, presets or
    options are a config error before any model is loaded."""
    from kvstreams.compaction import make_strategy
    from kvstreams.envs import make_env
    from kvstreams.policies import make_policy

    try:
        make_env(r.env, **r.env_args)
        if r.strategy:
            make_strategy(r.strategy, preset=r.strategy_preset, **r.strategy_args)
        if r.recall:
            _check_recall(r)
        if r.policy:
            policy = make_policy(r.policy, **r.policy_args)
            if not is_single_turn(r.env) and policy.evicts():
                from kvstreams.engine.compression import StreamBudget

                StreamBudget(policy)  # a budget multi-turn episodes cannot follow
    except KVStreamsError as err:
        raise ValueError(f"rollout: {err}") from None


def _check_recall(r: RolloutSection) -> None:
    from kvstreams.compaction.recall import check_mode, make_recall

    recall = make_recall(r.recall or "", **r.recall_args)
    if is_single_turn(r.env):
        raise KVStreamsError("recall brings back what compaction deleted: it needs a multi-turn environment")
    check_mode(recall, r.mode)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``data["a"]["b"] = value`` for ``dotted = "a.b"``, creating sections on the way."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise KVStreamsError(f"{dotted}: {key} is not a section")
    node[keys[-1]] = value


def parse_value(raw: str) -> Any:
    """A ``--set`` value: TOML (``1e-3``, ``true``, ``{a = 1}``, ``"x"``), else a bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_override(item: str) -> tuple[str, Any]:
    """One ``--set key=value``: the dotted key and its value (:func:`parse_value`)."""
    if "=" not in item:
        raise KVStreamsError(f"--set takes key=value, got {item!r}")
    key, raw = item.split("=", 1)
    return key.strip(), parse_value(raw.strip())


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    try:
        set_dotted(data, dotted, value)
    except KVStreamsError as err:
        raise KVStreamsError(f"--set {err}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or start from defaults), apply ``key=value`` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise KVStreamsError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as err:
            raise KVStreamsError(f"{p}: invalid TOML: {err}") from None
        except UnicodeDecodeError:
            raise KVStreamsError(f"{p}: not UTF-8 text (TOML files are UTF-8)") from None
    for item in overrides or []:
        _set(data, *parse_override(item))
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> Config:
    """A config from its TOML data; the first problem is one line (``KVStreamsError``)."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise KVStreamsError(f"bad config: {where + ': ' if where else ''}{message}{more}") from None


def to_toml(config: Config) -> str:
    """The resolved configuration as TOML (None values left out: TOML has no null)."""
    lines: list[str] = []
    for section, values in config.model_dump().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(type(value))

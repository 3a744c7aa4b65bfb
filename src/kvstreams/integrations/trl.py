"""kvstreams as a TRL plug-in: sample with kvstreams, train with TRL's ``GRPOTrainer``, and let TRL's
learner see what the sampler saw (``pip install kvstreams[trl]``; tested with trl 1.16).

- :class:`KVStreamsRollout` is a ``rollout_func`` for ``GRPOTrainer``. It plays kvstreams
  environments on ``trainer.model`` (single-turn or multi-turn; any KV compression policy; compaction
  in ``stream`` mode; recall), returns what TRL expects (``prompt_ids``, ``completion_ids``,
  ``logprobs``, ``env_mask`` = 0 on environment tokens) plus ``env_reward`` and ``kvstreams_trace``
  (both reach TRL's reward functions), and keeps the traces with their visibility record for the
  trainer. ``rollout.dataset(seeds)`` is the prompt dataset and
  ``rollout.reward`` the reward function that hands the environment's reward to TRL.
- :class:`KVStreamsGRPOTrainer` is a ``GRPOTrainer`` whose learner forward
  (``_get_per_token_logps_and_entropies``) replays each row's record, so old, reference and current
  log-probs are the shadow replay (the SMD paper's shadow mask, ratio 1) rather than dense attention
  over context the sampler had evicted. TRL's loss types, clipping, KL and logging are untouched.
  At every generation it logs kvstreams' ``mismatch/*`` (:mod:`kvstreams.train.mismatch`) and TRL's
  ``sampling/sampling_logp_difference/{mean,max}``; ``distill_coef > 0`` adds SMD's dense-to-masked
  distillation term.

Where this differs from TRL's own path: TRL corrects sampler/learner mismatch with importance
sampling (``vllm_importance_sampling_correction``), and only when vLLM samples; with a
``rollout_func`` on CPU it trains uncorrected. Here there is nothing to correct: the mismatch is float
error. Rows are laid out as TRL lays them (left-padded prompt, right-padded completion): the record
is shifted by each row's left padding, filler sees only itself, and positions are the sampler's
(counted from the first real token), where TRL's dense forward counts the padding.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from kvstreams.errors import KVStreamsError

TRL_TESTED = ("1.16",)  # the trl minor versions the plug-in's tests pass on


def require_trl() -> str:
    """The installed trl version, or one clear error when it is missing or untested."""
    try:
        version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise KVStreamsError("kvstreams.integrations.trl needs trl: pip install 'kvstreams[trl]'") from None
    if ".".join(version.split(".")[:2]) not in TRL_TESTED:
        raise KVStreamsError(
            f"kvstreams.integrations.trl is tested with trl {', '.join(v + '.x' for v in TRL_TESTED)}; "
            f"found trl {version}, whose GRPOTrainer internals may differ: pip install 'kvstreams[trl]'"
        )
    return version


require_trl()

from trl import GRPOTrainer  # noqa: E402  (after the version check, so a wrong trl fails in one line)

from kvstreams.attention import install as install_attention  # noqa: E402
from kvstreams.envs import make_env  # noqa: E402
from kvstreams.models import model_shape  # noqa: E402
from kvstreams.replay import ReplayMask, collate  # noqa: E402
from kvstreams.sampler import SamplerSpec, sample_episodes  # noqa: E402
from kvstreams.sampling import SamplingParams  # noqa: E402
from kvstreams.trace import Trace  # noqa: E402
from kvstreams.train import loss as losses  # noqa: E402
from kvstreams.train.config import RolloutSection  # noqa: E402
from kvstreams.train.mismatch import mismatch_metrics  # noqa: E402

TRL_BACKENDS = ("sdpa", "blocksparse")  # the replay backends with a backward on CPU
SEED_KEY = "kvstreams_seed"  # where a dataset prompt names its environment seed
# [rollout] fields GRPOConfig owns: the sampler takes them from the trainer's arguments.
_TRL_OWNED = ("temperature", "top_p", "top_k", "group_size", "prompts_per_step", "max_new_tokens")


class KVStreamsRollout:
    """``GRPOTrainer(rollout_func=...)`` backed by kvstreams' sampler.

    The keyword arguments are a config's ``[rollout]`` section
    (:class:`~kvstreams.train.config.RolloutSection`) minus what ``GRPOConfig`` owns (temperature,
    top-p/k, group size): ``env``, ``env_args``, ``policy`` and ``policy_args`` (KV compression while
    sampling), ``strategy`` (+ ``strategy_args``, ``strategy_preset``) and ``mode`` (``stream`` or
    ``full``; ``reprefill`` splits an episode into segments, which a TRL sample cannot hold),
    ``recall``, ``max_reply_tokens``, ``block_size``. ``GRPOConfig.max_completion_length`` bounds a
    single-turn reply; a multi-turn episode is bounded by its environment's turns and
    ``max_reply_tokens`` per reply, so its completion (replies and observations) can be longer.

    >>> rollout = KVStreamsRollout(env="recall", policy="snapkv", policy_args={"budget": 0.5})
    >>> trainer = KVStreamsGRPOTrainer(model, reward_funcs=rollout.reward, rollout_func=rollout,
    ...                                train_dataset=rollout.dataset(range(64)), args=GRPOConfig(...))
    """

    def __init__(self, **rollout: Any) -> None:
        owned = sorted(set(rollout) & set(_TRL_OWNED))
        if owned:
            raise KVStreamsError(f"set {', '.join(owned)} in GRPOConfig, not in KVStreamsRollout")
        section = RolloutSection(**rollout)
        if section.mode == "reprefill":
            raise KVStreamsError(
                "mode 'reprefill' splits an episode into segments, which one TRL sample cannot hold; "
                "use 'stream' (one trace, evictions recorded) or 'full'"
            )
        self.section = section
        self.spec = SamplerSpec.from_rollout(section)
        self.traces: list[Trace] = []  # the last call's, in prompt order (what the trainer replays)
        self._calls = 0

    def dataset(self, seeds: Sequence[int]):
        """A ``datasets.Dataset`` with one row per environment seed: ``prompt``, the environment's opening
        messages. TRL hands the rollout only prompts, and multi-turn environments open alike for every
        seed, so the last message carries the seed under ``kvstreams_seed`` (the model never reads the
        prompt text: the rollout resets the environment with that seed)."""
        from datasets import Dataset

        prompts = []
        for seed in seeds:
            messages = make_env(self.section.env, **self.section.env_args).reset(int(seed))
            messages[-1] = {**messages[-1], SEED_KEY: int(seed)}
            prompts.append(messages)
        return Dataset.from_dict({"prompt": prompts})

    @staticmethod
    def reward(completions: list, env_reward: list[float | None], **kwargs: Any) -> list[float | None]:
        """TRL reward function: the environment's reward for each episode (None for an episode whose
        environment failed: TRL gives it no advantage)."""
        return list(env_reward)

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        seeds = [self._seed_of(p) for p in prompts]
        args = trainer.args
        sampling = SamplingParams(
            max_new_tokens=args.max_completion_length or self.section.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed + 7919 * self._calls,
        )
        # every sample of a group plays the same task and draws differently
        sample_seeds = [self._calls * len(prompts) + i for i in range(len(prompts))]
        self._calls += 1
        model = trainer.accelerator.unwrap_model(trainer.model)
        envs = [make_env(self.section.env, **self.section.env_args) for _ in seeds]
        training = model.training
        model.eval()  # no dropout while sampling (the trainer warns when the model has any)
        try:
            results, _ = sample_episodes(
                model, trainer.processing_class, self.spec, envs, seeds, sampling, sample_seeds
            )
        finally:
            model.train(training)
            for env in envs:
                env.close()
        return self._to_trl(results)

    @staticmethod
    def _seed_of(prompt: Any) -> int:
        seed = prompt[-1].get(SEED_KEY) if isinstance(prompt, list) and prompt else None
        if seed is None:
            raise KVStreamsError(
                "TRL asked for a prompt that KVStreamsRollout.dataset did not make; build the train "
                "dataset with rollout.dataset(seeds)"
            )
        return int(seed)

    def _to_trl(self, results) -> dict[str, list]:
        """Each episode's one trace cut where the model starts writing: prompt before, completion after."""
        out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        out["env_reward"], out["kvstreams_trace"] = [], []  # both reach TRL's reward functions
        self.traces = []
        for result in results:
            if len(result.traces) != 1 or not bool(result.traces[0].sampled_mask.any()):
                raise KVStreamsError(
                    f"episode with environment seed {result.seed} produced no reply to train on"
                    + (f" ({result.error})" if result.error else "")
                )
            trace = result.traces[0]
            first = int(trace.sampled_mask.nonzero()[0])
            trained = trace.sampled_mask & trace.loss_mask
            if result.error:  # the environment failed mid-episode: nothing of it is trained on
                trained = torch.zeros_like(trained)
            out["prompt_ids"].append(trace.tokens[:first].tolist())
            out["completion_ids"].append(trace.tokens[first:].tolist())
            out["logprobs"].append(trace.sampler_logprobs[first:].tolist())
            out["env_mask"].append(trained[first:].int().tolist())
            out["env_reward"].append(None if result.error else float(result.reward))
            out["kvstreams_trace"].append(trace)
            self.traces.append(trace)
        return out


class KVStreamsGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose learner replays the sampler's visibility record.

    Takes ``GRPOTrainer``'s arguments, with ``rollout_func`` a :class:`KVStreamsRollout`, and:

    - ``replay``: ``"shadow"`` (default) runs every learner forward (old, reference, current) under
      each row's record; ``"dense"`` leaves TRL's forward as it is (stock TRL on the same rollouts:
      the baseline whose mismatch the metrics show).
    - ``backend``: kvstreams' attention backend for the replay: ``sdpa`` (a dense boolean mask) or
      ``blocksparse`` (only the visible key blocks; memory linear in length). ``flex`` is not offered:
      it has no backward on CPU and was never run under TRL.
    - ``distill_coef``: weight of SMD's distillation term, KL(dense || replayed) per completion token
      (:func:`kvstreams.train.loss.distillation_kl`); 0 leaves TRL's loss untouched.
    - ``log_dense_gap``: also log ``dense_gap/*``, the mismatch stock TRL would train with (one more
      no-grad forward per generation).

    Metrics are this process's (no gather across processes): the plug-in is tested on one process.
    """

    def __init__(
        self,
        *args: Any,
        rollout_func: KVStreamsRollout,
        replay: str = "shadow",
        backend: str = "sdpa",
        distill_coef: float = 0.0,
        log_dense_gap: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(rollout_func, KVStreamsRollout):
            raise KVStreamsError("KVStreamsGRPOTrainer needs rollout_func=KVStreamsRollout(...)")
        if replay not in ("shadow", "dense"):
            raise KVStreamsError(f"unknown replay {replay!r}; choose shadow or dense")
        if backend not in TRL_BACKENDS:
            raise KVStreamsError(
                f"backend {backend!r} is not offered here; choose {' or '.join(TRL_BACKENDS)}"
            )
        if distill_coef < 0:
            raise KVStreamsError(f"distill_coef must be >= 0, got {distill_coef}")
        super().__init__(*args, rollout_func=rollout_func, **kwargs)
        _check_args(self.args)
        self.kv_rollout = rollout_func
        self.replay, self.backend = replay, backend
        self.distill_coef, self.log_dense_gap = distill_coef, log_dense_gap
        self._rows: torch.Tensor | None = None  # row -> trace index in the batch being scored
        for model in (self.model, self.ref_model):
            if model is not None:
                _use_kvstreams_attention(self.accelerator.unwrap_model(model))

    # -- the learner forward -------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal: Any,
    ):
        """TRL's per-token log-probs of the completion columns, each row under its trace's record."""
        if self.replay == "dense":
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal,
            )  # fmt: skip
        if compute_aux_loss or any(v is not None for v in multimodal.values()):
            raise KVStreamsError("KVStreamsGRPOTrainer replays text-only, dense (non-MoE) models")
        rows = self._rows if self._rows is not None else torch.arange(input_ids.size(0))
        batch_size = batch_size or input_ids.size(0)
        n_heads = model_shape(self.accelerator.unwrap_model(model)).n_heads
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start : start + batch_size]
            traces = [self.kv_rollout.traces[int(r)] for r in rows[start : start + batch_size]]
            batch = self._replay_batch(model, traces, ids, logits_to_keep).to(ids.device)
            labels = ids.masked_fill(attention_mask[start : start + batch_size] == 0, -100)
            labels[:, :-logits_to_keep] = -100
            replay = ReplayMask(batch.death, self.backend, n_heads, batch.causal, batch.recalls)
            with replay, self.accelerator.autocast():
                out = model(input_ids=ids, position_ids=batch.positions, labels=labels, fused_lm_head=True)
            logps.append(out.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                entropies.append(out.entropy[:, -logits_to_keep:])
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _replay_batch(
        self, model, traces: list[Trace], ids: torch.Tensor, completion_width: int, mode: str = "shadow"
    ):
        """The traces laid out as TRL's rows: prompt right-aligned at column ``T - completion_width``."""
        shape = model_shape(self.accelerator.unwrap_model(model))
        prompt_width = ids.size(1) - completion_width
        offsets = [prompt_width - int(t.sampled_mask.nonzero()[0]) for t in traces]
        batch = collate(
            traces, shape.n_layers, shape.n_kv_heads, mode=mode, offsets=offsets, width=ids.size(1)
        )
        for row, start, n in batch.spans:
            if not torch.equal(ids[row, start : start + n].cpu(), batch.tokens[row, start : start + n]):
                raise KVStreamsError(
                    f"learner row {row} does not hold the tokens the rollout recorded; the trainer's "
                    "batch and kvstreams' traces are out of step"
                )
        return batch

    # -- where the record joins TRL's batch ----------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        self._rows = None  # old and reference log-probs are computed in rollout order
        output = super()._generate_and_score_completions(inputs)
        rows = output["prompt_ids"].size(0)
        output["kvstreams_row"] = torch.arange(rows, device=output["prompt_ids"].device)
        self._log_mismatch(output)
        return output

    def _compute_loss(self, model, inputs):
        self._rows = inputs["kvstreams_row"]  # shuffled and split with the rows
        try:
            loss = super()._compute_loss(model, inputs)
            if self.distill_coef > 0:
                loss = loss + self.distill_coef * self._distillation(model, inputs)
        finally:
            self._rows = None
        return loss

    def _distillation(self, model, inputs) -> torch.Tensor:
        """SMD's track B: KL(dense teacher || replayed student) per completion token, no gradient into
        the teacher, averaged over the micro-batch's trained tokens (scaled like TRL's loss for
        gradient accumulation). Costs a dense no-grad forward and a full-logits forward."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        width = inputs["completion_ids"].size(1)
        mask = _trained_mask(inputs)
        traces = [self.kv_rollout.traces[int(r)] for r in self._rows]
        student = self._completion_logits(model, traces, ids, width, "shadow")
        with torch.no_grad():
            teacher = torch.log_softmax(
                self._completion_logits(model, traces, ids, width, "dense").float(), -1
            )
        kl = losses.distillation_kl(teacher, student)  # [B, C]
        term = (kl * mask).sum() / mask.sum().clamp(min=1)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["loss/distill"].append(float(term.detach()))
        return term / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)

    def _completion_logits(self, model, traces, ids, width: int, mode: str) -> torch.Tensor:
        """Temperature-scaled logits [B, C, V] predicting the completion columns, under ``mode``'s
        visibility of each trace (``shadow``: its record; ``dense``: causal over the trace)."""
        batch = self._replay_batch(model, traces, ids, width, mode).to(ids.device)
        n_heads = model_shape(self.accelerator.unwrap_model(model)).n_heads
        with ReplayMask(batch.death, self.backend, n_heads, batch.causal, batch.recalls):
            logits = model(input_ids=ids, position_ids=batch.positions, use_cache=False).logits
        return logits[:, -width - 1 : -1] / self.temperature

    # -- metrics -------------------------------------------------------------------------------
    @torch.no_grad()
    def _log_mismatch(self, output: dict) -> None:
        """Sampler vs learner log-probs before any update, on the tokens the loss trains on."""
        mode = "train" if self.model.training else "eval"
        sampler = output.get("sampling_per_token_logps")
        if sampler is None:
            return
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        width = output["completion_ids"].size(1)
        size = (
            self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        )
        mask = _trained_mask(output).bool()
        learner = output.get("old_per_token_logps")
        if learner is None:
            learner = self._get_per_token_logps_and_entropies(self.model, ids, attention, width, size)[0]
        metrics = _mismatch(learner, sampler, mask, "mismatch/")
        if self.log_dense_gap:
            dense = GRPOTrainer._get_per_token_logps_and_entropies(
                self, self.model, ids, attention, width, size
            )
            metrics |= _mismatch(dense[0], sampler, mask, "dense_gap/")
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        self.last_mismatch = metrics


def _trained_mask(batch: dict) -> torch.Tensor:
    """[B, C] 1 on the completion tokens TRL's loss trains on (the model's, not the environment's)."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def _mismatch(learner: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict:
    """:func:`mismatch_metrics` over the masked tokens (keys under ``prefix``), plus TRL's own names for
    the two it has (``sampling/sampling_logp_difference/{mean,max}``) for the trained replay."""
    seq = torch.arange(mask.size(0), device=mask.device)[:, None].expand_as(mask)[mask]
    found = mismatch_metrics(learner[mask].float().cpu(), sampler[mask].float().cpu(), seq.cpu())
    metrics = {prefix + key.removeprefix("mismatch/"): value for key, value in found.items()}
    if prefix == "mismatch/":
        metrics["sampling/sampling_logp_difference/mean"] = found["mismatch/abs_logprob_diff_mean"]
        metrics["sampling/sampling_logp_difference/max"] = found["mismatch/abs_logprob_diff_max"]
    return metrics


def _check_args(args) -> None:
    """What would make the replay inexact, refused before anything runs."""
    if getattr(args, "use_vllm", False):
        raise KVStreamsError("KVStreamsGRPOTrainer samples with kvstreams, not vLLM: set use_vllm=False")
    if args.temperature <= 0:
        raise KVStreamsError(f"temperature must be > 0 (TRL divides logits by it), got {args.temperature}")
    truncating = {
        "top_k": args.top_k not in (0, None),
        "top_p": args.top_p != 1.0,
        "min_p": args.min_p is not None,
        "repetition_penalty": args.repetition_penalty != 1.0,
        "generation_kwargs": bool(args.generation_kwargs),
    }
    bad = [name for name, on in truncating.items() if on]
    if bad:
        raise KVStreamsError(
            f"GRPOConfig sets {', '.join(bad)}: TRL's loss scores tokens at temperature only, so a sampler "
            "that truncates the distribution would not be the policy trained; leave them at their defaults"
        )


def _use_kvstreams_attention(model) -> None:
    """Route the model's attention through kvstreams (outside a replay context it is transformers'
    SDPA unchanged), and warn about dropout: a random mask the sampler did not draw."""
    install_attention()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) != "kvstreams":
        base.set_attn_implementation("kvstreams")
    dropout = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if dropout:
        warnings.warn(
            f"{len(dropout)} dropout layers are active in training (e.g. {dropout[0]}); the learner's "
            "log-probs then differ from the sampler's by dropout noise (for LoRA: lora_dropout=0)",
            stacklevel=3,
        )

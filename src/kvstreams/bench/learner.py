"""`kvstreams bench learner`: what the learner pays to replay what the sampler saw.

Four measurements:

1. replay at trace length T (forward + backward of the trace's log-likelihood, tiny model) with the
   recorded visibility as a flex BlockMask, as a dense SDPA mask, through the block-sparse kernel,
   and with plain causal attention
   (the cost floor: no record at all). The record is synthetic but shaped like a real one: every
   layer and KV head keeps 4 sink entries and its own recent window of 1/8 to 1/4 of T.
2. one GRPO learner step on stream traces vs on the same episodes' re-prefill segments;
3. the SMD dual track (shadow + dense teacher forward) vs the shadow track alone;
4. the Shadow Mask paper's "not-in-place allocation spike": evicting half of a KV cache by gathering
   the retained entries into a new tensor, vs recording the eviction as a mask.

Peak memory is the resident high-water mark above the level at the start of each measurement on
CPU (``/proc/self/clear_refs``), allocated memory on CUDA.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstreams.bench.models import bench_model
from kvstreams.bench.report import (
    BenchReport,
    Target,
    available_memory,
    measure_peak,
    progress_bar,
    save_figure,
)
from kvstreams.trace import Trace

BACKENDS = ("causal", "sdpa", "flex", "blocksparse")


@dataclass
class LearnerBenchSettings:
    model: str = "tiny"  # the replay section's model: tiny, small, smollm2 or a directory
    learner_steps: bool = True  # the GRPO step section (tiny model, memory episodes)
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))
    step_episodes: int = 4
    step_turns: int = 24
    step_repeats: int = 3  # each learner step case is timed this many times (median reported)
    slice_tokens: int = 16384  # KV entries per (layer, head) in the slicing check, small model's shape
    keep_fraction: float = 0.5
    seed: int = 0

    @classmethod
    def preset(cls, quick: bool) -> LearnerBenchSettings:
        if quick:
            return cls(lengths=[256], step_episodes=2, step_turns=8, step_repeats=1, slice_tokens=2048)
        return cls()

    def on_model(self, model: str) -> LearnerBenchSettings:
        """Replay cost on another model (a real one: T = 512 and 2,048), without the GRPO step section."""
        return dataclasses.replace(self, model=model, lengths=[512, 2048], learner_steps=False)


def synthetic_trace(length: int, n_layers: int, n_kv_heads: int, vocab: int, seed: int = 0) -> Trace:
    """A trace whose record keeps, per layer and KV head, 4 sinks and a recent window of T/8..T/4."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, length // 8), max(2, length // 4)
    windows = torch.randint(lo, hi + 1, (n_layers, n_kv_heads, 1), generator=g)
    death = (torch.arange(length) + windows).clamp(max=length)
    death[:, :, :4] = length
    tokens = torch.randint(0, vocab, (length,), generator=g).tolist()
    flags = [False] + [True] * (length - 1)
    return Trace.from_record(
        tokens,
        death.to(torch.int32),
        flags,
        flags,
        [float("nan")] * length,
        [0] * length,
        {"source": "synthetic", "temperature": "1.0"},
    )


def _replay(model, trace: Trace, backend: str, backward: bool) -> None:
    """One learner forward over ``trace`` with ``backend``; with ``backward``, also the gradient of
    the trace's log-likelihood (the training pass), else under no_grad (pi_old, reference, teacher)."""
    from kvstreams.models import model_shape
    from kvstreams.replay import collate, replay_logits
    from kvstreams.replay.replay import FLEX_BLOCK_SIZE, token_logprobs

    shape = model_shape(model)
    # causal: the dense mode of one trace per row, which every backend runs as is_causal SDPA
    mode = "dense" if backend == "causal" else "shadow"
    multiple_of = FLEX_BLOCK_SIZE if backend == "flex" else 1
    batch = collate([trace], shape.n_layers, shape.n_kv_heads, mode=mode, multiple_of=multiple_of)
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        logits = replay_logits(model, batch, "sdpa" if backend == "causal" else backend)  # type: ignore[arg-type]
        loss = -token_logprobs(logits, batch)[0][1:].sum()
    if backward:
        loss.backward()
    model.zero_grad(set_to_none=True)


def _sdpa_mask_bytes(length: int, n_layers: int, n_heads: int) -> int:
    """What the dense path allocates at once: a bool mask per layer, a float copy and its scores."""
    return n_layers * n_heads * length**2 + 3 * 4 * n_heads * length**2


def bench_learner(settings: LearnerBenchSettings, models_dir: str | Path, out_dir: str | Path) -> BenchReport:
    from kvstreams.models import load_model, model_shape

    started = time.perf_counter()
    report = BenchReport("learner", settings=dict(settings.__dict__))
    replay = report.section(
        f"replay forward + backward at trace length T ({Path(settings.model).name} model)",
        ("T", "backend", "pass", "seconds", "peak MB", "peak / causal", "note"),
        note="causal: plain causal attention, no record (the floor); sdpa: recorded visibility as a dense "
        "T x T mask; flex: the same record as a flex_attention BlockMask (first call compiles, not timed); "
        "blocksparse: kvstreams' block-sparse kernel (visible key blocks only, recomputing backward)",
    )
    steps = None
    if settings.learner_steps:  # off with --model: the step section always runs the tiny model
        steps = report.section(
            "one GRPO learner step on the same episodes (tiny model, memory, sliding_window)",
            ("what", "backend", "traces", "tokens processed", "seconds", "peak MB"),
        )
    slicing = report.section(
        "evicting half of a KV cache in the learner: physical slicing vs mask (small model's KV shape)",
        ("method", "KV MB before", "peak extra MB", "peak / KV", "resident after MB"),
    )
    model, tok = load_model(bench_model(settings.model, models_dir))
    shape = model_shape(model)
    vocab = model.config.vocab_size
    n_runs = (
        2 * len(settings.lengths) * len(settings.backends)
        + 5 * settings.step_repeats * settings.learner_steps
        + 2
    )
    with progress_bar(n_runs) as step:
        warm = synthetic_trace(128, shape.n_layers, shape.n_kv_heads, vocab, settings.seed)
        for backend in ("causal", "sdpa"):  # lazy initialisation stays out of the first measurement
            _replay(model, warm, backend, backward=True)
        causal_peak: dict[tuple[int, str], int] = {}
        for length in settings.lengths:
            trace = synthetic_trace(length, shape.n_layers, shape.n_kv_heads, vocab, settings.seed)
            for backend in settings.backends:
                for backward in (False, True):
                    step(f"replay T={length} {backend} {'forward+backward' if backward else 'forward'}")
                    replay.rows.append(_replay_row(model, shape, trace, backend, backward, causal_peak))
        if steps is not None:
            steps.rows += _learner_steps(model, tok, settings, step)
        slicing.rows += _slicing(settings, step)
    _targets(report, replay.rows, slicing.rows)
    _training_targets(report, replay.rows, steps.rows if steps is not None else [])
    report.plots = _plots(replay.rows, Path(out_dir))
    report.seconds = time.perf_counter() - started
    return report


def _replay_row(
    model, shape, trace: Trace, backend: str, backward: bool, causal_peak: dict
) -> dict[str, Any]:
    length = len(trace)
    kind = "forward+backward" if backward else "forward"
    row: dict[str, Any] = {"T": length, "backend": backend, "pass": kind, "note": ""}
    device = str(next(model.parameters()).device)
    if backend == "flex" and backward and device == "cpu":
        row["note"] = "not run: torch's flex_attention has no backward on CPU"
        return row
    need = _sdpa_mask_bytes(length, shape.n_layers, shape.n_heads)
    avail = available_memory()
    if backend == "sdpa" and avail is not None and need > 0.6 * avail:
        row["note"] = f"skipped: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB free"
        return row
    if backend == "flex":
        _replay(model, trace, backend, backward)  # compiles for this shape: not timed
    with measure_peak(device) as peak:
        t0 = time.perf_counter()
        _replay(model, trace, backend, backward)
        row["seconds"] = time.perf_counter() - t0
    row["peak MB"] = peak.extra / 2**20
    if backend == "causal":
        causal_peak[(length, kind)] = peak.extra
    if causal_peak.get((length, kind)):
        row["peak / causal"] = peak.extra / causal_peak[(length, kind)]
    return row


def _learner_steps(model, tok, settings: LearnerBenchSettings, step) -> list[dict[str, Any]]:
    from kvstreams.compaction import make_strategy
    from kvstreams.envs import make_env
    from kvstreams.sampler import SamplerSpec, sample_episodes
    from kvstreams.sampling import SamplingParams
    from kvstreams.train.learner import Learner
    from kvstreams.train.prepare import learner_items
    from kvstreams.train.rollouts import RolloutBatch, Sample

    n = settings.step_episodes
    batches = {}
    for mode in ("stream", "reprefill"):
        envs = [
            make_env("memory", n_turns=settings.step_turns, max_turns=settings.step_turns + 1)
            for _ in range(n)
        ]
        spec = SamplerSpec("memory", make_strategy("sliding_window"), mode)
        results, stats = sample_episodes(
            model, tok, spec, envs, list(range(n)), SamplingParams(seed=settings.seed)
        )
        rewards = [float(i % 2) for i in range(n)]  # a fixed spread: advantages are non-zero
        samples = [Sample(t, 0, r.episode, rewards[r.episode]) for r in results for t in r.traces]
        batches[mode] = RolloutBatch(samples, rewards, stats)
    cases = [
        ("stream traces, shadow", "stream", "shadow", 0.0, "auto"),
        ("re-prefill segments", "reprefill", "reprefill", 0.0, "auto"),
        ("stream traces, SMD dual track (lambda 0.1)", "stream", "shadow", 0.1, "auto"),
        ("stream traces, shadow", "stream", "shadow", 0.0, "sdpa"),
        ("re-prefill segments", "reprefill", "reprefill", 0.0, "sdpa"),
    ]
    configs = [
        _step_config(n, mode, correction, distill, backend) for _, mode, correction, distill, backend in cases
    ]
    times: list[list[float]] = [[] for _ in cases]
    peaks = [0.0] * len(cases)
    # repeats interleaved across cases, so a drift in the machine's load reaches every case alike
    for _ in range(settings.step_repeats):
        for i, ((what, mode, *_), cfg) in enumerate(zip(cases, configs, strict=True)):
            step(f"learner step: {what} ({cfg.train.backend})")
            learner = Learner(copy.deepcopy(model), cfg)
            items, _ = learner_items(batches[mode], 0, n, True, cfg.train.max_off_policy_steps)
            with measure_peak() as peak:
                t0 = time.perf_counter()
                learner.step(items)
                times[i].append(time.perf_counter() - t0)
            peaks[i] = max(peaks[i], peak.extra / 2**20)
    return [
        {
            "what": what,
            "backend": f"{cfg.train.backend}, {'packed' if cfg.optim.packed else 'padded'}",
            "traces": len(batches[mode].samples),
            "tokens processed": sum(len(s.trace) for s in batches[mode].samples) * (2 if distill else 1),
            "seconds": statistics.median(times[i]),
            "peak MB": peaks[i],
        }
        for i, ((what, mode, _, distill, _), cfg) in enumerate(zip(cases, configs, strict=True))
    ]


def _step_config(n: int, mode: str, correction: str, distill: float, backend: str):
    from kvstreams.train.config import Config

    return Config.model_validate(
        {
            "rollout": {"group_size": n, "prompts_per_step": 1, "mode": mode, "strategy": "sliding_window"},
            "loss": {"type": correction, "kl_coef": 0.0}
            | ({"distill_coef": distill} if correction == "shadow" else {}),
            "train": {"steps": 1, "backend": backend},
        }
    )


def _slicing(settings: LearnerBenchSettings, step) -> list[dict[str, Any]]:
    """Half of every (layer, head) row of a KV cache is evicted: gather vs mask."""
    from kvstreams.bench.models import BENCH_MODELS

    cfg = BENCH_MODELS["small"]
    L, H, D, T = cfg["layers"], cfg["heads"] // 2, cfg["hidden"] // cfg["heads"], settings.slice_tokens
    keep = int(T * settings.keep_fraction)
    g = torch.Generator().manual_seed(settings.seed)
    rows = []
    for method in ("physical slicing (gather)", "mask (record death)"):
        step(f"eviction: {method}")
        keys, values = torch.randn(L, H, T, D, generator=g), torch.randn(L, H, T, D, generator=g)
        kv = 2 * keys.numel() * keys.element_size()
        scores = torch.rand(L, H, T, generator=g)
        with measure_peak() as peak:
            kept = scores.topk(keep, dim=-1).indices
            if method.startswith("physical"):
                index = kept.unsqueeze(-1).expand(-1, -1, -1, D)
                keys, values = keys.gather(2, index), values.gather(2, index)  # new tensors, then the old go
                after = 2 * keys.numel() * keys.element_size()
            else:
                alive = torch.zeros(L, H, T, dtype=torch.bool).scatter_(-1, kept, True)
                death = torch.where(alive, torch.iinfo(torch.int32).max, T).to(torch.int32)
                after = kv + death.numel() * death.element_size()
        rows.append(
            {
                "method": method,
                "KV MB before": kv / 2**20,
                "peak extra MB": peak.extra / 2**20,
                "peak / KV": (kv + peak.extra) / kv,
                "resident after MB": after / 2**20,
            }
        )
        del keys, values
    return rows


def _targets(report: BenchReport, replay: list[dict], slicing: list[dict]) -> None:
    masked = [r for r in replay if r["backend"] != "causal" and r.get("peak / causal") is not None]
    best: dict[tuple[int, str], dict] = {}
    for r in masked:
        key = (r["T"], r["pass"])
        if key not in best or r["peak / causal"] < best[key]["peak / causal"]:
            best[key] = r
    worst = max((r["peak / causal"] for r in best.values()), default=None)
    report.targets.append(
        Target(
            "masked replay peak memory vs plain causal (best backend per T and pass)",
            "<= 1.05x",
            "-"
            if worst is None
            else "; ".join(
                f"T={t} {p}: {r['backend']} {r['peak / causal']:.2f}x" for (t, p), r in sorted(best.items())
            ),
            None if worst is None else worst <= 1.05,
        )
    )
    flex = sorted(
        (r["T"], r["peak MB"])
        for r in replay
        if r["backend"] == "flex" and r["pass"] == "forward" and r.get("peak MB")
    )
    if len(flex) >= 2:
        (t0, m0), (t1, m1) = flex[0], flex[-1]
        growth = m1 / max(m0, 1e-9)
        report.targets.append(
            Target(
                "flex replay (forward) memory sub-quadratic in T",
                f"growth < (T ratio)^2 = {(t1 / t0) ** 2:.0f}x",
                f"{growth:.1f}x for T x{t1 / t0:.0f}",
                growth < (t1 / t0) ** 2,
            )
        )
    if len(slicing) == 2:
        s, m = slicing
        report.targets.append(
            Target(
                "physical slicing spike shown, mask has none",
                "slicing peak ~1.5x KV, mask ~1.0x",
                f"slicing {s['peak / KV']:.2f}x, mask {m['peak / KV']:.2f}x",
                s["peak / KV"] > 1.3 and m["peak / KV"] < 1.05,
            )
        )


def _training_targets(report: BenchReport, replay: list[dict], steps: list[dict]) -> None:
    """Issue #11's targets for the CPU learner: the training pass near causal memory at long T, and a
    learner step on stream traces well under the same episodes' re-prefill segments."""
    passes = [
        r
        for r in replay
        if r["backend"] == "blocksparse"
        and r["pass"] == "forward+backward"
        and r["T"] >= 4096
        and r.get("peak / causal")
    ]
    if passes:
        report.targets.append(
            Target(
                "block-sparse training pass peak memory vs plain causal, T >= 4k",
                "<= 1.2x",
                "; ".join(f"T={r['T']}: {r['peak / causal']:.2f}x" for r in passes),
                max(r["peak / causal"] for r in passes) <= 1.2,
            )
        )
    default = [r for r in steps if not r["backend"].startswith("sdpa")]
    stream = next((r for r in default if r["what"] == "stream traces, shadow"), None)
    segments = next((r for r in default if r["what"] == "re-prefill segments"), None)
    if stream and segments:
        ratio = stream["seconds"] / segments["seconds"]
        report.targets.append(
            Target(
                f"learner step, stream traces vs re-prefill segments ({stream['backend']})",
                "<= 0.6x",
                f"{ratio:.2f}x ({stream['seconds']:.1f} s vs {segments['seconds']:.1f} s)",
                ratio <= 0.6,
            )
        )


def _plots(replay: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, backend in enumerate(BACKENDS):
        for kind, style in (("forward", "o--"), ("forward+backward", "o-")):
            rows = [r for r in replay if r["backend"] == backend and r["pass"] == kind and r.get("seconds")]
            if not rows:
                continue
            label = f"{backend} {kind}"
            ts = [r["T"] for r in rows]
            axes[0].plot(ts, [r["seconds"] for r in rows], style, color=f"C{i}", label=label)
            axes[1].plot(ts, [max(r["peak MB"], 1e-2) for r in rows], style, color=f"C{i}", label=label)
    for ax, label in zip(axes, ("seconds", "peak memory above start (MB)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("trace length T")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("learner replay: recorded visibility vs plain causal attention")
    return [save_figure(fig, out / "learner_replay.png")]

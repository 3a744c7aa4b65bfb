"""`kvstreams bench roofline`: how far kvstreams runs from what this machine can do.

Three parts, one run:

- **The machine's limit.** Matrix-multiply GFLOP/s (fp32 and bf16, ``torch.matmul`` at the model's own
  projection shapes, with the threads the bench runs with) and memory bandwidth (a large tensor copy,
  counted as read + write). The peak is the best shape's figure.
- **Each phase against it.** Prefill, decode (batch 1 to 64, full cache and SnapKV at 50%) and the
  learner's forward + backward (shadow replay, block-sparse backend, the CPU training default), as
  achieved GFLOP/s and as model FLOPs utilisation (MFU) of the fp32 peak; batch-1 decode against the
  bandwidth bound (every weight read once per token). Model FLOPs per token: 2 x the parameters of
  every ``nn.Linear`` (the LM head included) + 4 x layers x heads x head_dim x the keys attended
  (QK^T and AV); forward + backward is 3 x the forward. These are the standard counts (Kaplan et al.
  2020, "Scaling laws", Sec. 2.1; PaLM's MFU, Chowdhery et al. 2022, App. B); we count attention over
  the keys actually visible (half of them under SnapKV at 50%), not over a fixed context.
- **Where the rest goes.** ``torch.profiler`` over one decode call: the linear layers, kvstreams'
  attention over the slot cache, the eviction (scoring, selection, bookkeeping), sampling, and the
  rest (Python, norms, RoPE, activations).

The llama.cpp side by side (the CPU engine a user would pick) is :mod:`kvstreams.bench.llama_cpp`,
added to this report when ``--llama-cpp`` names a llama.cpp build.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstreams.bench.models import bench_model
from kvstreams.bench.report import BenchReport, Target, progress_bar


@dataclass
class RooflineBenchSettings:
    models: list[str] = field(default_factory=lambda: ["smollm2"])
    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    prompt_len: int = 128
    new_tokens: int = 64
    budget: float = 0.5  # SnapKV's share of each sequence's entries kept
    learner_batch: int = 8  # traces per learner forward + backward
    gemm_tokens: list[int] = field(default_factory=lambda: [1, 32, 2048])  # M of the GEMM probes
    copy_mb: int = 512
    repeats: int = 2  # the best of these is reported
    seed: int = 0
    llama_cpp: str | None = None  # a llama.cpp directory with build/bin/llama-batched-bench
    # one GRPO step's cost: episodes x reply tokens, shadow replay, SnapKV at ``budget``; fp32, bf16, LoRA
    step_episodes: int = 64
    step_reply_tokens: int = 128
    step_micro_batch: int = 8  # traces per learner forward + backward

    @classmethod
    def preset(cls, quick: bool) -> RooflineBenchSettings:
        if quick:
            return cls(
                models=["tiny"], batches=[1, 4], prompt_len=128, new_tokens=32, learner_batch=2,
                gemm_tokens=[1, 64], copy_mb=64, repeats=1, step_episodes=4, step_reply_tokens=32,
                step_micro_batch=2,
            )  # fmt: skip
        return cls()

    def on_model(self, model: str) -> RooflineBenchSettings:
        return dataclasses.replace(self, models=[model])


# --- the machine ----------------------------------------------------------------------------------------
def _best_seconds(fn, repeats: int, min_seconds: float = 0.2) -> float:
    """Seconds per call of ``fn``: calls are repeated until ``min_seconds`` pass, best of ``repeats``."""
    fn()  # warm up (allocations, kernel selection)
    best = float("inf")
    for _ in range(max(1, repeats)):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / n)
    return best


def gemm_rows(shapes: list[tuple[int, int, int]], repeats: int) -> list[dict[str, Any]]:
    """GFLOP/s of ``A[M, K] @ B[K, N]`` in fp32 and bf16 at each shape."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in shapes:
            a = torch.randn(m, k).to(dtype)
            b = torch.randn(k, n).to(dtype)
            seconds = _best_seconds(lambda a=a, b=b: torch.matmul(a, b), repeats)
            rows.append(
                {"dtype": str(dtype).removeprefix("torch."), "M": m, "K": k, "N": n,
                 "GFLOP/s": 2 * m * k * n / seconds / 1e9}
            )  # fmt: skip
    return rows


def bandwidth_gbs(megabytes: int, repeats: int) -> float:
    """Memory bandwidth from a large copy (bytes read + bytes written per second)."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / seconds / 1e9


def projection_shapes(model, tokens: list[int]) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's distinct linear layers, for each M in ``tokens``."""
    kn = sorted({(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    return [(t, k, n) for t in tokens for k, n in kn]


# --- model FLOPs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlopModel:
    linear_params: int  # parameters of every nn.Linear (LM head included)
    attention_per_key: int  # FLOPs per query token per visible key: 4 x layers x heads x head_dim

    @classmethod
    def of(cls, model) -> FlopModel:
        from kvstreams.models import model_shape

        shape = model_shape(model)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        return cls(linear, 4 * shape.n_layers * shape.n_heads * shape.head_dim)

    def forward(self, tokens: int, keys_per_token: float) -> float:
        """Forward FLOPs of ``tokens`` query tokens attending to ``keys_per_token`` keys on average."""
        return tokens * (2 * self.linear_params + self.attention_per_key * keys_per_token)

    def weight_bytes(self, bytes_per_param: int = 4) -> int:
        return self.linear_params * bytes_per_param


# --- the phases -----------------------------------------------------------------------------------------
def _generate_seconds(engine, prompts, params, repeats: int) -> tuple[float, list]:
    best, traces = float("inf"), []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        traces = engine.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
    return best, traces


def phase_rows(model, tok, label: str, settings: RooflineBenchSettings, peak: float, step) -> list[dict]:
    """Prefill, decode (full and SnapKV) and learner rows for one model at every batch."""
    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.policies import make_policy
    from kvstreams.prompts import synthetic_prompts

    flops = FlopModel.of(model)
    P, G = settings.prompt_len, settings.new_tokens
    rows: list[dict] = []
    traces_for_learner: list = []
    for batch in settings.batches:
        prompts = synthetic_prompts(tok, batch, P, seed=settings.seed)
        full = RolloutEngine(model, tok, make_policy("full"))
        one = SamplingParams(max_new_tokens=1, stop_token_ids=(), seed=settings.seed)
        step(f"{label} batch {batch}: prefill")
        prefill_s, _ = _generate_seconds(full, prompts, one, settings.repeats)
        rows.append(
            _row(label, "prefill", batch, batch * P, prefill_s, flops.forward(batch * P, P / 2), peak)
        )
        params = SamplingParams(max_new_tokens=G, stop_token_ids=(), seed=settings.seed)
        for policy in ("full", "snapkv"):
            step(f"{label} batch {batch}: decode {policy}")
            options = {} if policy == "full" else {"budget": settings.budget, "budget_of": "context"}
            engine = RolloutEngine(model, tok, make_policy(policy, **options))
            total_s, traces = _generate_seconds(engine, prompts, params, settings.repeats)
            keys = mean_keys(traces, sampled_only=True)
            decode_s = max(total_s - prefill_s, 1e-9)
            name = "decode" if policy == "full" else f"decode snapkv {settings.budget:.0%}"
            rows.append(_row(label, name, batch, batch * G, decode_s, flops.forward(batch * G, keys), peak))
            if policy == "snapkv" and len(traces) >= len(traces_for_learner):
                traces_for_learner = traces
    step(f"{label}: learner forward + backward")
    rows.append(
        _learner_row(model, label, traces_for_learner[: settings.learner_batch], flops, peak, settings)
    )
    return rows


def mean_keys(traces, sampled_only: bool) -> float:
    """Keys a query attended to, averaged over layers, KV heads and the queries (those that sampled a
    token, or every position), from the traces' own record."""
    total = count = 0.0
    for t in traces:
        counts = t.visible_counts().float().mean(dim=(0, 1))  # [T]
        if sampled_only:
            counts = counts[t.sampled_mask.nonzero().squeeze(-1) - 1]
        total, count = total + float(counts.sum()), count + counts.numel()
    return total / max(count, 1)


def _row(label: str, phase: str, batch: int, tokens: int, seconds: float, flop: float, peak: float) -> dict:
    return {
        "model": label,
        "phase": phase,
        "batch": batch,
        "tokens": tokens,
        "seconds": seconds,
        "tokens/s": tokens / seconds,
        "GFLOP/s": flop / seconds / 1e9,
        "MFU fp32": flop / seconds / 1e9 / peak,
    }


def _learner_row(model, label, traces, flops: FlopModel, peak: float, settings) -> dict:
    """One forward + backward of the shadow replay (block-sparse) over ``traces`` in one micro-batch,
    best of repeats."""

    tokens = sum(len(t) for t in traces)
    keys = mean_keys(traces, sampled_only=False)
    best = min(_learner_pass(model, traces, len(traces))[0] for _ in range(max(1, settings.repeats)))
    return _row(label, "learner fwd+bwd", len(traces), tokens, best, 3 * flops.forward(tokens, keys), peak)


# --- where the time goes --------------------------------------------------------------------------------
RANGES = {  # profiler ranges the engine marks, and what they hold
    "attention": "kvstreams::attend",  # K/V write, attention over the live slots, policy statistics
    "eviction": "kvstreams::evict",  # scoring, selection, the death record, slot bookkeeping
    "sampling": "kvstreams::sample",
}


def profile_row(model, tok, label: str, policy: str, batch: int, settings: RooflineBenchSettings) -> dict:
    """One decode call under ``torch.profiler``: each part's share of the profiled wall-clock."""
    from torch.profiler import ProfilerActivity, profile

    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.policies import make_policy
    from kvstreams.prompts import synthetic_prompts

    options = {} if policy == "full" else {"budget": settings.budget, "budget_of": "context"}
    engine = RolloutEngine(model, tok, make_policy(policy, **options))
    prompts = synthetic_prompts(tok, batch, settings.prompt_len, seed=settings.seed)
    params = SamplingParams(max_new_tokens=settings.new_tokens, stop_token_ids=(), seed=settings.seed)
    engine.generate(prompts, params)  # warm up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - start
    totals = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
    parts = {"linear": totals.get("aten::linear", 0.0)}
    parts |= {name: totals.get(key, 0.0) for name, key in RANGES.items()}
    parts["rest"] = max(0.0, wall - sum(parts.values()))
    row: dict[str, Any] = {"model": label, "policy": policy, "batch": batch, "profiled s": wall}
    return row | {f"{name} %": 100 * seconds / wall for name, seconds in parts.items()}


# --- one GRPO step -------------------------------------------------------------------------------------
STEP_VARIANTS = ("fp32", "bf16", "fp32 + LoRA r=8")


def step_row(path: Path, label: str, variant: str, settings: RooflineBenchSettings) -> dict:
    """Rollout (SnapKV at ``budget``, ``step_episodes`` x ``step_reply_tokens``) and learner (shadow
    replay, block-sparse, forward + backward of every trace in micro-batches; no optimizer) of one GRPO
    step, with the replay's agreement with the sampler on the sampled tokens."""
    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.models import load_model
    from kvstreams.policies import make_policy
    from kvstreams.prompts import synthetic_prompts

    model, tok = load_model(path, dtype="bfloat16" if variant == "bf16" else "float32")
    if "LoRA" in variant:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            return {
                "model": label,
                "variant": f"{variant}: not run (peft missing: pip install 'kvstreams[trl]')",
            }

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    prompts = synthetic_prompts(tok, settings.step_episodes, settings.prompt_len, seed=settings.seed)
    engine = RolloutEngine(model, tok, make_policy("snapkv", budget=settings.budget))
    params = SamplingParams(max_new_tokens=settings.step_reply_tokens, stop_token_ids=(), seed=settings.seed)
    start = time.perf_counter()
    traces = engine.generate(prompts, params)
    rollout_s = time.perf_counter() - start
    learner_s, gap, peak_bytes = _learner_pass(model, traces, settings.step_micro_batch)
    tokens = sum(len(t) for t in traces)
    return {
        "model": label, "variant": variant, "episodes": len(traces), "rollout s": rollout_s,
        "rollout tokens/s": settings.step_episodes * settings.step_reply_tokens / rollout_s,
        "learner s": learner_s, "learner tokens/s": tokens / learner_s, "step s": rollout_s + learner_s,
        "learner peak MB": peak_bytes / 2**20, "shadow max |Δ log p|": gap,
    }  # fmt: skip


def _learner_pass(model, traces, micro_batch: int) -> tuple[float, float, int]:
    """(seconds, max |learner - sampler| log-prob on sampled tokens, peak bytes) of forward + backward
    of the sampled tokens' log-probs (one gather per micro-batch, as the learner does), in train mode."""
    from kvstreams.bench.report import measure_peak
    from kvstreams.models import model_shape
    from kvstreams.replay import collate, predicting_rows, replay_logits
    from kvstreams.sampling import policy_logprobs

    shape = model_shape(model)
    model.train()
    gap, seconds, peak_bytes = 0.0, 0.0, 0
    try:
        for i in range(0, len(traces), micro_batch):
            chunk = traces[i : i + micro_batch]
            batch = collate(chunk, shape.n_layers, shape.n_kv_heads, mode="shadow")
            positions = [t.sampled_mask.nonzero().squeeze(-1) for t in chunk]
            with measure_peak() as peak:
                start = time.perf_counter()
                rows, targets = predicting_rows(
                    replay_logits(model, batch, backend="blocksparse"), batch, positions
                )
                logp = policy_logprobs(rows, targets, chunk[0].temperature, chunk[0].top_k, chunk[0].top_p)
                logp.sum().backward()
                seconds += time.perf_counter() - start
            peak_bytes = max(peak_bytes, peak.extra)
            sampler = torch.cat([t.sampler_logprobs[p] for t, p in zip(chunk, positions, strict=True)])
            gap = max(gap, float((logp.detach().float().cpu() - sampler).abs().max()))
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    return seconds, gap, peak_bytes


# --- the bench ------------------------------------------------------------------------------------------
def bench_roofline(
    settings: RooflineBenchSettings, models_dir: str | Path, out_dir: str | Path
) -> BenchReport:
    from kvstreams.models import load_model

    started = time.perf_counter()
    report = BenchReport("roofline", settings=dict(settings.__dict__))
    peaks, phases, profiles, steps = _sections(report, settings)
    per_model = 2 + 3 * len(settings.batches) + 1 + 2 + len(STEP_VARIANTS) + (1 if settings.llama_cpp else 0)
    with progress_bar(per_model * len(settings.models)) as step:
        for name in settings.models:
            model, tok = load_model(bench_model(name, models_dir))
            label = Path(name).name if Path(name).is_dir() else name
            step(f"{label}: GEMM peak and bandwidth")
            gemm = gemm_rows(projection_shapes(model, settings.gemm_tokens), settings.repeats)
            bandwidth = bandwidth_gbs(settings.copy_mb, settings.repeats)
            peak = {d: max(r["GFLOP/s"] for r in gemm if r["dtype"] == d) for d in ("float32", "bfloat16")}
            peaks.rows += [{"model": label, **r} for r in gemm]
            report.settings[f"peak {label}"] = {"fp32 GFLOP/s": peak["float32"], "bf16 GFLOP/s": peak["bfloat16"],
                                                "bandwidth GB/s": bandwidth}  # fmt: skip
            rows = phase_rows(model, tok, label, settings, peak["float32"], step)
            bound = bandwidth * 1e9 / FlopModel.of(model).weight_bytes(4)  # tokens/s, weights read once
            for row in rows:
                row["bandwidth bound tokens/s"] = (
                    bound if row["batch"] == 1 and row["phase"] == "decode" else None
                )
            phases.rows += rows
            for policy in ("full", "snapkv"):
                step(f"{label}: profile decode {policy}")
                profiles.rows.append(profile_row(model, tok, label, policy, max(settings.batches), settings))
            for variant in STEP_VARIANTS:
                step(f"{label}: one GRPO step, {variant}")
                steps.rows.append(step_row(bench_model(name, models_dir), label, variant, settings))
            if settings.llama_cpp:
                from kvstreams.bench.llama_cpp import gguf_source, llama_cpp_rows

                step(f"{label}: llama.cpp")
                llama = llama_cpp_rows(settings, label, gguf_source(name), rows, Path(out_dir))
                report.sections.append(llama)
                _llama_target(report, llama.rows)
    _targets(report, phases.rows, steps.rows)
    report.plots = _plots(phases.rows, report.settings, Path(out_dir))
    report.seconds = time.perf_counter() - started
    return report


def _sections(report: BenchReport, settings: RooflineBenchSettings):
    peaks = report.section(
        "matrix-multiply throughput at the model's projection shapes (A[M, K] @ B[K, N])",
        ("model", "dtype", "M", "K", "N", "GFLOP/s"),
        note="the peak is the best row of each dtype; bandwidth (a large copy, read + write) is in settings",
    )
    phases = report.section(
        f"phases: prompts of {settings.prompt_len} tokens, {settings.new_tokens} new tokens, fp32",
        ("model", "phase", "batch", "tokens", "seconds", "tokens/s", "GFLOP/s", "MFU fp32",
         "bandwidth bound tokens/s"),
        note="decode seconds exclude the prefill (measured alone); MFU: model FLOPs / s over the fp32 "
        "GEMM peak; bandwidth bound: every weight read once per token (batch 1)",
    )  # fmt: skip
    profiles = report.section(
        f"where a decode call's time goes (torch.profiler, batch {max(settings.batches)}, prefill included)",
        ("model", "policy", "batch", "profiled s", "linear %", "attention %", "eviction %", "sampling %", "rest %"),
        note="linear: every nn.Linear (LM head included); attention: K/V write + attention over the live "
        "slots + policy statistics; eviction: scoring, selection, death record; rest: Python, norms, "
        "RoPE, activations, prefill attention, profiler overhead",
    )  # fmt: skip
    steps = report.section(
        f"one GRPO step: {settings.step_episodes} episodes x {settings.step_reply_tokens}-token replies after "
        f"{settings.prompt_len}-token prompts, SnapKV at {settings.budget:.0%}, shadow replay",
        ("model", "variant", "episodes", "rollout s", "rollout tokens/s", "learner s", "learner tokens/s",
         "step s", "learner peak MB", "shadow max |Δ log p|"),
        note="learner: forward + backward of every trace (block-sparse, micro-batches of "
        f"{settings.step_micro_batch}), no optimizer step; shadow max |Δ log p|: replay vs sampler on the "
        "sampled tokens (bf16: compare with the bf16 floor of docs/real-model.md)",
    )  # fmt: skip
    return peaks, phases, profiles, steps


def _targets(report: BenchReport, rows: list[dict], steps: list[dict]) -> None:
    """The issue's goals, each met or missed with the measured ratio."""
    timed = [r for r in steps if "step s" in r]
    if timed:
        report.targets.append(
            Target(
                "one GRPO step (rollout + learner forward/backward)",
                "<= 90 s",
                ", ".join(f"{r['model']} {r['variant']}: {r['step s']:.0f} s" for r in timed),
                all(r["step s"] <= 90 for r in timed),
            )
        )
    at32 = [r for r in rows if r["batch"] == 32 and r["phase"] in ("decode", "decode snapkv 50%")]
    learner = [r for r in rows if r["phase"] == "learner fwd+bwd"]
    for name, chosen in (("decode at batch 32", at32), ("learner forward + backward", learner)):
        if chosen:
            report.targets.append(
                Target(
                    f"{name}: model FLOPs utilisation of the fp32 GEMM peak",
                    ">= 40%",
                    ", ".join(f"{r['model']} {r['phase']}: {r['MFU fp32']:.1%}" for r in chosen),
                    all(r["MFU fp32"] >= 0.4 for r in chosen),
                )
            )
    single = [r for r in rows if r["bandwidth bound tokens/s"]]
    if single:
        report.targets.append(
            Target(
                "batch-1 decode against the bandwidth bound (bound tokens/s over achieved)",
                "<= 1.5x",
                ", ".join(
                    f"{r['model']}: {r['bandwidth bound tokens/s'] / r['tokens/s']:.1f}x" for r in single
                ),
                all(r["bandwidth bound tokens/s"] / r["tokens/s"] <= 1.5 for r in single),
            )
        )


def _llama_target(report: BenchReport, rows: list[dict]) -> None:
    same = [r for r in rows if r.get("precision") == "F32" and "decode tokens/s" in r]
    if same:
        report.targets.append(
            Target(
                "batched decode tokens/s vs llama.cpp at the same precision (fp32), per batch",
                ">= 1.0x",
                ", ".join(f"x{r['batch']}: {r['kvstreams fp32 / this']:.2f}x" for r in same),
                all(r["kvstreams fp32 / this"] >= 1.0 for r in same),
            )
        )


def _plots(rows: list[dict], settings: dict, out: Path) -> list[str]:
    """Achieved GFLOP/s per phase and batch, under the fp32 and bf16 peaks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvstreams.bench.report import save_figure

    paths = []
    for model in sorted({r["model"] for r in rows}):
        fig, ax = plt.subplots(figsize=(7, 4))
        mine = [r for r in rows if r["model"] == model]
        for phase in dict.fromkeys(r["phase"] for r in mine):
            points = [(r["batch"], r["GFLOP/s"]) for r in mine if r["phase"] == phase]
            ax.plot(*zip(*points, strict=True), marker="o", label=phase)
        peak = settings[f"peak {model}"]
        ax.axhline(peak["fp32 GFLOP/s"], color="k", linestyle="--", label="fp32 GEMM peak")
        ax.axhline(peak["bf16 GFLOP/s"], color="grey", linestyle=":", label="bf16 GEMM peak")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # decode at batch 1 sits two decades under the peaks
        ax.set_xlabel("batch (learner: traces)")
        ax.set_ylabel("achieved GFLOP/s (model FLOPs)")
        ax.set_title(f"{model}: each phase against this machine's peak")
        ax.legend(fontsize=7)
        paths.append(save_figure(fig, out / f"roofline-{model}.png"))
    return paths

"""`kvstreams bench decode`: the kvstreams engine's decode throughput vs Hugging Face ``generate``.

Same model weights, prompts, batch and lengths (every sequence decodes exactly ``new_tokens``, no
stop token, temperature 1): Hugging Face ``generate`` with its default (dynamic) cache and SDPA
attention; the kvstreams engine without eviction (``full``); and the engine with compression
policies at a budget of half the context. Throughput counts generated tokens over the whole call
(prefill included), the way a rollout worker experiences it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstreams.atomic import write_json
from kvstreams.bench.kvpress_decode import generate as hf_generate
from kvstreams.bench.models import bench_model
from kvstreams.bench.report import BenchReport, Target, measure_peak, progress_bar, save_figure


@dataclass
class DecodeBenchSettings:
    models: list[str] = field(default_factory=lambda: ["tiny", "small"])
    batches: list[int] = field(default_factory=lambda: [8])
    prompt_len: int = 128
    new_tokens: int = 256
    # knorm and streaming_llm as kvpress's presses; snapkv, the score-based one (attention statistics)
    policies: list[str] = field(default_factory=lambda: ["knorm", "snapkv", "streaming_llm"])
    budget: float = 0.5
    repeats: int = 3  # the best of these is reported (this machine's run-to-run noise is +-10-30%)
    seed: int = 0
    kvpress_python: str | None = None  # a Python with kvpress installed (it pins transformers < 5.3)

    @classmethod
    def preset(cls, quick: bool) -> DecodeBenchSettings:
        if quick:
            return cls(
                models=["tiny"], batches=[2], prompt_len=64, new_tokens=96, policies=["snapkv"], repeats=1
            )
        return cls()

    def on_model(self, model: str) -> DecodeBenchSettings:
        """A real model (a directory, or smollm2) at batch 1, 8 and 32, 64 new tokens."""
        return dataclasses.replace(self, models=[model], batches=[1, 8, 32], new_tokens=64, repeats=2)


def bench_decode(settings: DecodeBenchSettings, models_dir: str | Path, out_dir: str | Path) -> BenchReport:
    from transformers import AutoModelForCausalLM

    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.models import load_model, model_shape
    from kvstreams.prompts import synthetic_prompts

    started = time.perf_counter()
    report = BenchReport("decode", settings=dict(settings.__dict__))
    table, kvpress = _sections(report, settings)
    n_runs = len(settings.models) * len(settings.batches) * (3 + len(settings.policies))
    params = SamplingParams(
        max_new_tokens=settings.new_tokens, temperature=1.0, stop_token_ids=(), seed=settings.seed
    )
    with progress_bar(n_runs) as step:
        for name in settings.models:
            path = bench_model(name, models_dir)
            model, tok = load_model(path)
            hf = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="sdpa", dtype=torch.float32
            ).eval()
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            label = Path(name).name if Path(name).is_dir() else name
            for batch in settings.batches:
                prompts = synthetic_prompts(tok, batch, settings.prompt_len, seed=settings.seed)
                hf_generate(hf, [p[:8] for p in prompts[:2]], 4, pad, settings.seed)  # warm up both
                RolloutEngine(model, tok).generate(
                    [p[:8] for p in prompts[:2]], SamplingParams(max_new_tokens=4)
                )
                step(f"{label} batch {batch}: HF generate")
                hf_row = _hf_row(hf, model_shape(model), prompts, pad, settings)
                table.rows.append({"model": label, "batch": batch, **hf_row})
                for policy_name in ["full", *settings.policies]:
                    step(f"{label} batch {batch}: kvstreams {policy_name}")
                    row = _engine_row(model, tok, policy_name, prompts, params, settings)
                    row["vs HF generate"] = row["tokens/s"] / hf_row["tokens/s"]
                    table.rows.append({"model": label, "batch": batch, **row})
                step(f"{label} batch {batch}: kvpress")
                kvpress.rows += [
                    {"batch": batch, **r}
                    for r in _kvpress_rows(settings, label, path, prompts, pad, Path(out_dir))
                ]
    _targets(report, table.rows)
    report.plots = _plots(table.rows, Path(out_dir))
    report.seconds = time.perf_counter() - started
    return report


def _sections(report: BenchReport, settings: DecodeBenchSettings):
    """The report's two tables: kvstreams and HF generate side by side, and kvpress's presses."""
    table = report.section(
        f"decode batch x {settings.new_tokens} tokens after {settings.prompt_len}-token prompts",
        (
            "model",
            "batch",
            "engine",
            "policy",
            "tokens",
            "seconds",
            "tokens/s",
            "vs HF generate",
            "KV MB",
            "peak MB",
        ),
        note="KV MB: K/V the cache holds at the end (HF: dynamic cache, grows with the sequence; "
        "kvstreams: slots allocated); peak MB: resident high-water mark above the start of the call",
    )
    kvpress = report.section(
        "kvpress DecodingPress (HF generate + press, separate environment) at the same budget",
        (
            "model",
            "batch",
            "policy",
            "tokens",
            "seconds",
            "tokens/s",
            "vs HF generate",
            "KV entries at end",
            "note",
        ),
        note="vs HF generate: against plain generate in that environment (its transformers version)",
    )
    return table, kvpress


def _hf_row(hf, shape, prompts: list[list[int]], pad: int, settings: DecodeBenchSettings) -> dict[str, Any]:
    best, peak_extra, tokens = float("inf"), 0, 0
    for _ in range(settings.repeats):
        with torch.no_grad(), measure_peak() as peak:
            t0 = time.perf_counter()
            tokens, _ = hf_generate(hf, prompts, settings.new_tokens, pad, settings.seed)
            best = min(best, time.perf_counter() - t0)
        peak_extra = max(peak_extra, peak.extra)
    context = settings.prompt_len + settings.new_tokens
    hf_kv = 2 * shape.n_layers * len(prompts) * shape.n_kv_heads * context * shape.head_dim * 4
    return {
        "engine": "HF generate",
        "policy": "-",
        "tokens": tokens,
        "seconds": best,
        "tokens/s": tokens / best,
        "vs HF generate": 1.0,
        "KV MB": hf_kv / 2**20,
        "peak MB": peak_extra / 2**20,
    }


def _engine_row(
    model, tok, policy_name: str, prompts, params, settings: DecodeBenchSettings
) -> dict[str, Any]:
    from kvstreams.engine import RolloutEngine
    from kvstreams.policies import make_policy

    # a budget fixed by the context (prompt + new tokens), as kvpress' presses compress to
    options = {} if policy_name == "full" else {"budget": settings.budget, "budget_of": "context"}
    engine = RolloutEngine(model, tok, make_policy(policy_name, **options))
    best, peak_extra = float("inf"), 0
    for _ in range(settings.repeats):
        with measure_peak() as peak:
            t0 = time.perf_counter()
            traces = engine.generate(prompts, params)
            best = min(best, time.perf_counter() - t0)
        peak_extra = max(peak_extra, peak.extra)
    tokens = sum(int(t.sampled_mask.sum()) for t in traces)
    return {
        "engine": "kvstreams",
        "policy": policy_name if policy_name == "full" else f"{policy_name} {settings.budget:.0%}",
        "tokens": tokens,
        "seconds": best,
        "tokens/s": tokens / best,
        "KV MB": engine.last_stats.kv_bytes_allocated / 2**20,
        "peak MB": peak_extra / 2**20,
    }


def _kvpress_rows(
    settings: DecodeBenchSettings, model: str, path: Path, prompts: list[list[int]], pad: int, out: Path
) -> list[dict[str, Any]]:
    """Run kvpress_decode.py with the kvpress environment's Python, at the kvstreams policies' budget."""
    if not settings.kvpress_python:
        return [{"model": model, "note": "not run: pass --kvpress-python (make kvpress-env builds one)"}]
    budget = int(settings.budget * (settings.prompt_len + settings.new_tokens))
    job = {
        "model": str(path),
        "prompts": prompts,
        "new_tokens": settings.new_tokens,
        "pad_id": pad,
        "target_size": budget,
        "compression_interval": 32,  # as the kvstreams policies' default interval
        "repeats": settings.repeats,
        "seed": settings.seed,
    }
    job_path = write_json(out / f"kvpress-job-{model}.json", job)
    script = Path(__file__).with_name("kvpress_decode.py")
    done = subprocess.run(
        [settings.kvpress_python, str(script), str(job_path)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return [{"model": model, "note": f"kvpress run failed: {tail[0][:200]}"}]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    plain = next(r for r in result["rows"] if r["policy"] == "none")
    rows = []
    for r in result["rows"]:
        rate = r["tokens"] / r["seconds"]
        rows.append(
            {
                "model": model,
                "policy": "HF generate" if r["policy"] == "none" else r["policy"],
                "tokens": r["tokens"],
                "seconds": r["seconds"],
                "tokens/s": rate,
                "vs HF generate": rate / (plain["tokens"] / plain["seconds"]),
                "KV entries at end": r["kv_entries"],
                "note": f"kvpress {result['kvpress']}, transformers {result['transformers']}",
            }
        )
    return rows


def _targets(report: BenchReport, rows: list[dict[str, Any]]) -> None:
    full = [r for r in rows if r["engine"] == "kvstreams" and r["policy"] == "full"]
    report.targets.append(
        Target(
            "engine decode tokens/s vs HF generate (no eviction)",
            ">= 1.0x",
            ", ".join(f"{r['model']} x{r['batch']}: {r['vs HF generate']:.2f}x" for r in full),
            min(r["vs HF generate"] for r in full) >= 1.0 if full else None,
        )
    )
    evicting = [
        r
        for r in rows
        if r["engine"] == "kvstreams" and r["batch"] == 8 and r["policy"].split()[0] in ("knorm", "snapkv")
    ]
    if evicting:
        report.targets.append(
            Target(
                "engine decode with eviction (knorm, snapkv at 50%) vs HF generate, batch 8",
                ">= 1.2x",
                ", ".join(f"{r['model']} {r['policy']}: {r['vs HF generate']:.2f}x" for r in evicting),
                min(r["vs HF generate"] for r in evicting) >= 1.2,
            )
        )


def _plots(rows: list[dict[str, Any]], out: Path) -> list[str]:
    """Per model, generated tokens/s of every engine and policy, grouped by batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        batches = list(dict.fromkeys(r["batch"] for r in mine))
        engines = list(dict.fromkeys(f"{r['engine']} {r['policy']}".replace(" -", "") for r in mine))
        width = 0.8 / len(engines)
        for k, engine in enumerate(engines):
            values = [
                next(
                    r["tokens/s"]
                    for r in mine
                    if r["batch"] == b and f"{r['engine']} {r['policy']}".replace(" -", "") == engine
                )
                for b in batches
            ]
            color = "gray" if engine == "HF generate" else f"C{k}"
            ax.bar([i + k * width for i in range(len(batches))], values, width, label=engine, color=color)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_ylabel("generated tokens/s")
        ax.set_title(model)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("decode throughput")
    return [save_figure(fig, out / "decode.png")]

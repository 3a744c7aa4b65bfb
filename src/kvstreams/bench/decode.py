"""`kvstreams bench decode`: the kvstreams engine's decode throughput vs Hugging Face ``generate``.

Same model weights, prompts, batch and lengths (every sequence decodes exactly ``new_tokens``, no
stop token, temperature 1): Hugging Face ``generate`` with its default (dynamic) cache and SDPA
attention; the kvstreams engine without eviction (``full``); and the engine with compression
policies at a budget of half the context. Throughput counts generated tokens over the whole call
(prefill included), the way a rollout worker experiences it.
"""

from __future__ import annotations

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
    batch: int = 8
    prompt_len: int = 128
    new_tokens: int = 256
    policies: list[str] = field(default_factory=lambda: ["knorm", "streaming_llm"])  # as kvpress's presses
    budget: float = 0.5
    repeats: int = 1  # the best of these is reported
    seed: int = 0
    kvpress_python: str | None = None  # a Python with kvpress installed (it pins transformers < 5.3)

    @classmethod
    def preset(cls, quick: bool) -> DecodeBenchSettings:
        if quick:
            return cls(models=["tiny"], batch=2, prompt_len=64, new_tokens=96, policies=["snapkv"], repeats=1)
        return cls()


def bench_decode(settings: DecodeBenchSettings, models_dir: str | Path, out_dir: str | Path) -> BenchReport:
    from transformers import AutoModelForCausalLM

    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.models import load_model, model_shape
    from kvstreams.policies import make_policy
    from kvstreams.prompts import synthetic_prompts

    started = time.perf_counter()
    report = BenchReport("decode", settings=dict(settings.__dict__))
    table = report.section(
        f"decode {settings.batch} x {settings.new_tokens} tokens after {settings.prompt_len}-token prompts",
        ("model", "engine", "policy", "tokens", "seconds", "tokens/s", "vs HF generate", "KV MB", "peak MB"),
        note="KV MB: K/V the cache holds at the end (HF: dynamic cache, grows with the sequence; "
        "kvstreams: slots allocated); peak MB: resident high-water mark above the start of the call",
    )
    kvpress = report.section(
        "kvpress DecodingPress (HF generate + press, separate environment) at the same budget",
        ("model", "policy", "tokens", "seconds", "tokens/s", "vs HF generate", "KV entries at end", "note"),
        note="vs HF generate: against plain generate in that environment (its transformers version)",
    )
    n_runs = len(settings.models) * (3 + len(settings.policies))
    params = SamplingParams(
        max_new_tokens=settings.new_tokens, temperature=1.0, stop_token_ids=(), seed=settings.seed
    )
    with progress_bar(n_runs) as step:
        for name in settings.models:
            path = bench_model(name, models_dir)
            model, tok = load_model(path)
            shape = model_shape(model)
            prompts = synthetic_prompts(tok, settings.batch, settings.prompt_len, seed=settings.seed)
            hf = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="sdpa", dtype=torch.float32
            ).eval()
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            hf_generate(hf, [p[:8] for p in prompts[:2]], 4, pad, settings.seed)  # warm up both
            RolloutEngine(model, tok).generate([p[:8] for p in prompts[:2]], SamplingParams(max_new_tokens=4))

            step(f"{name}: HF generate")
            best, peak_extra, tokens = float("inf"), 0, 0
            for _ in range(settings.repeats):
                with torch.no_grad(), measure_peak() as peak:
                    t0 = time.perf_counter()
                    tokens, _ = hf_generate(hf, prompts, settings.new_tokens, pad, settings.seed)
                    best = min(best, time.perf_counter() - t0)
                peak_extra = max(peak_extra, peak.extra)
            context = settings.prompt_len + settings.new_tokens
            hf_kv = 2 * shape.n_layers * settings.batch * shape.n_kv_heads * context * shape.head_dim * 4
            hf_rate = tokens / best
            table.rows.append(
                {
                    "model": name,
                    "engine": "HF generate",
                    "policy": "-",
                    "tokens": tokens,
                    "seconds": best,
                    "tokens/s": hf_rate,
                    "vs HF generate": 1.0,
                    "KV MB": hf_kv / 2**20,
                    "peak MB": peak_extra / 2**20,
                }
            )
            del hf
            for policy_name in ["full", *settings.policies]:
                step(f"{name}: kvstreams {policy_name}")
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
                table.rows.append(
                    {
                        "model": name,
                        "engine": "kvstreams",
                        "policy": policy_name
                        if policy_name == "full"
                        else f"{policy_name} {settings.budget:.0%}",
                        "tokens": tokens,
                        "seconds": best,
                        "tokens/s": tokens / best,
                        "vs HF generate": tokens / best / hf_rate,
                        "KV MB": engine.last_stats.kv_bytes_allocated / 2**20,
                        "peak MB": peak_extra / 2**20,
                    }
                )
            step(f"{name}: kvpress")
            kvpress.rows += _kvpress_rows(settings, name, path, prompts, pad, Path(out_dir))
    _targets(report, table.rows)
    report.plots = _plots(table.rows, Path(out_dir))
    report.seconds = time.perf_counter() - started
    return report


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
            ", ".join(f"{r['model']}: {r['vs HF generate']:.2f}x" for r in full),
            min(r["vs HF generate"] for r in full) >= 1.0 if full else None,
        )
    )


def _plots(rows: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    models = sorted({r["model"] for r in rows}, key=lambda m: [r["model"] for r in rows].index(m))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        labels = [r["engine"] if r["policy"] == "-" else f"kvstreams\n{r['policy']}" for r in mine]
        ax.bar(range(len(mine)), [r["tokens/s"] for r in mine], color=["gray"] + ["C0"] * (len(mine) - 1))
        ax.set_xticks(range(len(mine)), labels, fontsize=8)
        ax.set_ylabel("generated tokens/s")
        ax.set_title(model)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("decode throughput")
    return [save_figure(fig, out / "decode.png")]

"""`kvstreams bench rollout`: stream vs re-prefill vs full context, side by side in one run.

Every point is one (model, environment, compaction strategy, budget B) played in the three modes
with the same seeds. A random model's replies run to ``max_reply_tokens`` almost every time, so the
modes play nearly the same number of tokens; the counters (not the samples) are what is compared.

What the KV-streams paper predicts: re-prefill forwards N * r / (B - r) extra tokens for N new ones
(r: the context retained by a compaction, B: the context when it fires), so its cost relative to
stream mode is B / (B - r) in tokens; whether wall-clock follows depends on how much of the time is
spent on those (chunked, cheap per token) prefills rather than on (one token per step) decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstreams.bench.models import bench_model, parameter_count
from kvstreams.bench.report import BenchReport, Target, progress_bar, save_figure


@dataclass(frozen=True)
class Point:
    """One compaction setting played by ``episodes`` episodes of ``turns`` turns; ``token_budget``
    None is the environment's default B (or the preset's); ``preset`` names the strategy's settings."""

    model: str
    env: str
    strategy: str
    token_budget: int | None = None
    episodes: int = 4
    turns: int = 40
    preset: str | None = None

    @property
    def label(self) -> str:
        return f"{self.strategy} ({self.preset})" if self.preset else self.strategy


@dataclass
class RolloutBenchSettings:
    points: list[Point]
    max_reply_tokens: int = 16
    filler_block: int = 16  # tiny-model stream runs are repeated at this block size to count filler
    kv_turns: list[int] = field(default_factory=list)  # episode lengths of the KV-growth check (tiny)
    kv_episodes: int = 2
    full_context: bool = True  # also play each point's episodes with the full context (no compaction)
    # (policy, budget) pairs compressing inside each tiny model's stream runs: compaction alone vs
    # compaction + compression, same seeds (kvstreams.engine.compression)
    compose: list[tuple[str, float | int]] = field(default_factory=list)
    seed: int = 0

    def on_model(self, model: str) -> RolloutBenchSettings:
        from kvstreams.errors import KVStreamsError

        raise KVStreamsError(
            "bench rollout plays its own tiny and small models; --model is for decode, learner and premise"
        )

    @classmethod
    def preset(cls, quick: bool) -> RolloutBenchSettings:
        if quick:  # keeps the command working in CI: small, not meaningful
            return cls(
                points=[
                    Point("tiny", "memory", "sliding_window", 192, episodes=2, turns=10),
                    Point("tiny", "memory", "markovian", 192, episodes=2, turns=10),
                ],
                max_reply_tokens=8,
                kv_turns=[4, 8],
                compose=[("snapkv", 96)],
            )
        tiny = [Point("tiny", "memory", s) for s in ("sliding_window", "markovian")]
        # bridges make these two slow on a random model (every summary runs to its token limit)
        tiny += [Point("tiny", "memory", s, episodes=2, turns=24) for s in ("summary", "model_triggered")]
        tiny += [Point("tiny", "memory", "sliding_window", 768)]
        # TextWorld with the KV-streams authors' turn-triggered settings (the setting of their 5x figure)
        tiny += [
            Point("tiny", "textworld", s, episodes=2, turns=30, preset="kvstreams")
            for s in ("sliding_window", "markovian")
        ]
        small = [
            Point("small", "memory", "sliding_window", 768, episodes=4, turns=20),
            Point("small", "memory", "markovian", episodes=4, turns=16),
        ]
        compose = [("snapkv", 128), ("h2o", 128), ("streaming_llm", 128), ("snapkv", 0.5)]
        return cls(points=tiny + small, kv_turns=[10, 20, 40, 80], kv_episodes=1, compose=compose)

    @classmethod
    def curve(cls, quick: bool = False) -> RolloutBenchSettings:
        """``bench rollout --curve``: the wall-clock speed-up of stream over re-prefill on the small
        model across r/B (sliding window at B = 384, 768, 1536 on ``memory``: r/B ~0.7, ~0.87, ~0.93)
        and episode length (20, 40, 80 turns: more compactions per episode), 2 episodes a point; the
        full-context mode is left out (about 40 minutes on 2 cores)."""
        if quick:
            points = [
                Point("tiny", "memory", "sliding_window", b, episodes=1, turns=t)
                for b in (192, 256)
                for t in (6, 12)
            ]
            return cls(points=points, max_reply_tokens=8, full_context=False)
        points = [
            Point("small", "memory", "sliding_window", b, episodes=2, turns=t)
            for b in (384, 768, 1536)
            for t in (20, 40, 80)
        ]
        return cls(points=points, full_context=False)


def _env_args(env: str, turns: int) -> dict[str, Any]:
    if env == "memory":
        return {"n_turns": turns, "max_turns": turns + 1}
    return {"max_turns": turns}


def play(
    model,
    tokenizer,
    point: Point,
    mode: str,
    settings: RolloutBenchSettings,
    block_size: int = 1,
    policy: tuple[str, float | int] | None = None,
) -> dict[str, Any]:
    """Play ``episodes`` episodes of ``point`` in ``mode`` (with ``policy`` = (name, budget)
    compressing inside them, if given); one row of figures."""
    from kvstreams.compaction import make_strategy
    from kvstreams.envs import make_env
    from kvstreams.policies import make_policy
    from kvstreams.sampler import SamplerSpec, sample_episodes
    from kvstreams.sampling import SamplingParams

    strategy = None
    if mode != "full":
        options = {"token_budget": point.token_budget} if point.token_budget else {}
        strategy = make_strategy(point.strategy, preset=point.preset, **options)
    episodes = point.episodes
    envs = [make_env(point.env, **_env_args(point.env, point.turns)) for _ in range(episodes)]
    spec = SamplerSpec(
        env=point.env,
        strategy=strategy,
        mode=mode,  # type: ignore[arg-type]
        policy=make_policy(policy[0], budget=policy[1]) if policy else None,
        block_size=block_size,
        max_reply_tokens=settings.max_reply_tokens,
    )
    sampling = SamplingParams(temperature=1.0, seed=settings.seed)
    _, st = sample_episodes(
        model, tokenizer, spec, envs, [settings.seed + i for i in range(episodes)], sampling
    )
    b = strategy.with_token_budget(envs[0].token_budget).token_budget_in_force if strategy else None
    return _play_row(point, mode, policy, block_size, b, st)


def _play_row(point: Point, mode: str, policy, block_size: int, b: int | None, st) -> dict[str, Any]:
    """The figures of one :func:`play` from its rollout cost ``st``."""
    episodes = point.episodes
    retained = st.retained_mean / st.context_at_compaction_mean if st.compactions else None
    predicted = st.tokens_reprefilled_predicted if mode == "reprefill" else None
    steady = st.tokens_reprefilled_predicted_steady if mode == "reprefill" else None
    return {
        "model": point.model,
        "env": point.env,
        "strategy": point.label if mode != "full" else "-",
        "B": b,
        "mode": mode,
        "policy": f"{policy[0]} {policy[1]}" if policy else "-",
        "block": block_size,
        "episodes": episodes,
        "compactions/ep": st.compactions / episodes,
        "r/B": retained,
        "tokens fwd": st.tokens_forwarded,
        "re-prefilled": st.tokens_reprefilled,
        "closed form": predicted,
        "closed form err": (st.tokens_reprefilled / predicted - 1) if predicted else None,
        "steady form": steady,
        "steady err": (st.tokens_reprefilled / steady - 1) if steady else None,
        "filler": st.tokens_filler,
        "seconds": st.seconds,
        "decode tok/s": st.decode_tokens / st.decode_seconds if st.decode_seconds else None,
        "chunk s": st.chunk_seconds,
        "peak KV entries": st.kv_peak_entries,
        "peak KV MB": st.kv_peak_bytes / 2**20,
        "trace tokens": st.tokens_trace,
    }


# Printed columns (the JSON rows hold every figure, e.g. "chunk s" and "peak KV entries").
RUN_COLUMNS = (
    "model", "env", "strategy", "B", "mode", "compactions/ep", "r/B", "tokens fwd", "re-prefilled",
    "closed form", "closed form err", "steady err", "seconds", "decode tok/s", "peak KV MB",
)  # fmt: skip
RATIO_COLUMNS = (
    "model", "env", "strategy", "B", "turns", "r/B", "B/(B-r)", "tokens reprefill/stream", "wall reprefill/stream",
    "wall full/stream", "filler b=16 %",
)  # fmt: skip


def _same_episodes(p: Point) -> tuple:
    """Points that play the same episodes share one full-context run."""
    return (p.model, p.env, p.episodes, p.turns)


def _n_runs(settings: RolloutBenchSettings, filler_points: list[Point]) -> int:
    """How many :func:`play` runs the bench makes (for its progress bar)."""
    n_full = len({_same_episodes(p) for p in settings.points}) if settings.full_context else 0
    n_runs = 2 * len(settings.points) + len(filler_points) + n_full + 2 * len(settings.kv_turns)
    return n_runs + len(settings.compose) * sum(p.model == "tiny" for p in settings.points)


def _play_point(model, tok, point: Point, settings: RolloutBenchSettings, filler: bool, step):
    """The point in stream and re-prefill mode (and with ``filler``, stream at the filler block size):
    the rows by mode, and the blocked row or None."""
    name = f"{point.model} {point.env} {point.label} B={point.token_budget or 'env'}"
    rows = {}
    for mode in ("stream", "reprefill"):
        step(f"{name} {mode}")
        rows[mode] = play(model, tok, point, mode, settings)
    blocked = None
    if filler:
        step(f"{name} stream at block size {settings.filler_block}")
        blocked = play(model, tok, point, "stream", settings, block_size=settings.filler_block)
    return rows, blocked


def bench_rollout(settings: RolloutBenchSettings, models_dir: str | Path, out_dir: str | Path) -> BenchReport:
    from kvstreams.models import load_model

    started = time.perf_counter()
    report = BenchReport(
        "rollout", settings={**settings.__dict__, "points": [p.__dict__ for p in settings.points]}
    )
    runs = report.section(
        "runs (same seeds in every mode)",
        RUN_COLUMNS,
        note="closed form: N r/(B-r) with N the new tokens, r and B averaged over compactions; steady: the "
        "same over the tokens after each episode's first compaction (the first fill re-prefills nothing); "
        "peak KV MB: K/V allocated for the batch",
    )
    ratios = report.section("reprefill and full context relative to stream", RATIO_COLUMNS)
    growth = report.section(
        "peak KV vs episode length (tiny, memory, sliding_window)",
        ("mode", "turns", "trace tokens", "peak KV entries", "peak KV MB"),
    )
    compose = report.section(
        "compaction alone vs compaction + compression (tiny, stream mode, same seeds)",
        COMPOSE_COLUMNS,
        note="policy: name and budget (entries per layer and KV head, or a share of the tokens fed); "
        "peak KV entries: most live entries of any row between forwards; peak KV MB: K/V allocated, which "
        "includes a chunk's transient entries; relative figures: over the same point's compaction alone",
    )
    models: dict[str, Any] = {}
    full_rows: dict[tuple, dict[str, Any]] = {}
    # filler does not depend on the model
    filler_points = [p for p in settings.points if p.model == "tiny" and settings.full_context]
    with progress_bar(_n_runs(settings, filler_points)) as step:
        for point in settings.points:
            if point.model not in models:
                model, tok = load_model(bench_model(point.model, models_dir))
                models[point.model] = (model, tok)
                report.settings.setdefault("parameters", {})[point.model] = parameter_count(model)
            model, tok = models[point.model]
            rows, blocked = _play_point(model, tok, point, settings, point in filler_points, step)
            runs.rows += [rows["stream"], rows["reprefill"]]
            key = _same_episodes(point)
            if key not in full_rows and settings.full_context:
                step(f"{point.model} {point.env} full context")
                full_rows[key] = play(model, tok, point, "full", settings)
                runs.rows.append(full_rows[key])
            ratios.rows.append(
                _ratio_row(point, rows["stream"], rows["reprefill"], full_rows.get(key), blocked)
            )
            for policy in settings.compose if point.model == "tiny" else []:
                step(f"{point.model} {point.env} {point.label} stream + {policy[0]} {policy[1]}")
                compose.rows.append(
                    _compose_row(rows["stream"], play(model, tok, point, "stream", settings, policy=policy))
                )
        if settings.kv_turns:
            model, tok = models.get("tiny") or load_model(bench_model("tiny", models_dir))
            growth.rows += _kv_growth(model, tok, settings, step)
    _targets(report, runs.rows, ratios.rows, growth.rows)
    report.plots = _plots(ratios.rows, growth.rows, Path(out_dir))
    report.seconds = time.perf_counter() - started
    return report


COMPOSE_COLUMNS = (
    "env", "strategy", "B", "policy", "compactions/ep", "tokens fwd", "peak KV entries", "KV entries rel",
    "peak KV MB", "KV MB rel", "seconds", "seconds rel",
)  # fmt: skip


def _compose_row(alone: dict[str, Any], both: dict[str, Any]) -> dict[str, Any]:
    """A stream run with compression inside it, next to the same point's compaction alone."""
    row = {k: both[k] for k in COMPOSE_COLUMNS if k in both}
    rel = {"KV entries rel": "peak KV entries", "KV MB rel": "peak KV MB", "seconds rel": "seconds"}
    for name, key in rel.items():
        row[name] = both[key] / alone[key] if alone[key] else None
    return row


def _ratio_row(point: Point, s: dict, r: dict, f: dict | None, blocked: dict | None) -> dict[str, Any]:
    """One point's re-prefill (``r``) and full-context (``f``) runs relative to its stream run (``s``);
    ``blocked``: the stream run with block-padded units (filler counts)."""
    rb = r["r/B"]
    return {
        "model": point.model,
        "env": point.env,
        "strategy": point.label,
        "B": s["B"],
        "turns": point.turns,
        "r/B": rb,
        "B/(B-r)": 1 / (1 - rb) if rb is not None and rb < 1 else None,
        "tokens reprefill/stream": r["tokens fwd"] / s["tokens fwd"],
        "wall reprefill/stream": r["seconds"] / s["seconds"],
        "wall full/stream": f["seconds"] / s["seconds"] if f else None,
        "filler b=1": s["filler"],
        "filler b=16": blocked["filler"] if blocked else None,
        "filler b=16 %": 100 * blocked["filler"] / blocked["trace tokens"] if blocked else None,
        "stream compactions/ep": s["compactions/ep"],
    }


def _kv_growth(model, tok, settings: RolloutBenchSettings, step) -> list[dict[str, Any]]:
    """Peak KV against episode length (tiny model, memory, sliding window): stream stays flat, full
    context grows with the turns."""
    rows = []
    for turns in settings.kv_turns:
        point = Point("tiny", "memory", "sliding_window", episodes=settings.kv_episodes, turns=turns)
        for mode in ("stream", "full"):
            step(f"KV growth: {mode}, {turns} turns")
            row = play(model, tok, point, mode, settings)
            rows.append(
                {
                    "mode": mode,
                    "turns": turns,
                    "trace tokens": row["trace tokens"] // settings.kv_episodes,
                    "peak KV entries": row["peak KV entries"],
                    "peak KV MB": row["peak KV MB"],
                }
            )
    return rows


def _targets(report: BenchReport, runs: list[dict], ratios: list[dict], growth: list[dict]) -> None:
    stream = [r for r in runs if r["mode"] == "stream"]
    worst = max((r["re-prefilled"] for r in stream), default=0)
    report.targets.append(
        Target("stream re-prefills", "0 tokens", f"max {worst}", worst == 0 if stream else None)
    )
    long = [r for r in runs if r["mode"] == "reprefill" and r["closed form"] and r["compactions/ep"] >= 8]
    for key, label in (
        ("closed form err", "N r/(B-r)"),
        ("steady err", "(N - N0) r/(B-r), N0 the first fill"),
    ):
        errors = [abs(r[key]) for r in long if r[key] is not None]
        worst = max(errors, default=None)
        within = sum(e <= 0.10 for e in errors)
        report.targets.append(
            Target(
                f"re-prefill extra vs {label}",
                "within 10% (runs with >= 8 compactions per episode)",
                "-"
                if worst is None
                else f"{within} of {len(errors)} runs within 10%, worst {100 * worst:.0f}%",
                None if worst is None else worst <= 0.10,
            )
        )
    high = [r for r in ratios if r["model"] == "small" and r["r/B"] is not None and r["r/B"] >= 0.8]
    best = max((r["wall reprefill/stream"] for r in high), default=None)
    report.targets.append(
        Target(
            "wall-clock reprefill/stream, small model, r/B >= 0.8",
            ">= 3x",
            "not run" if best is None else f"{best:.2f}x",
            None if best is None else best >= 3.0,
        )
    )
    if growth:
        s = [g for g in growth if g["mode"] == "stream"]
        f = [g for g in growth if g["mode"] == "full"]
        flat = max(g["peak KV entries"] for g in s) <= 1.1 * min(g["peak KV entries"] for g in s[1:] or s)
        grow = f[-1]["peak KV entries"] / f[0]["peak KV entries"]
        length = f[-1]["trace tokens"] / f[0]["trace tokens"]
        report.targets.append(
            Target(
                "peak KV: stream flat, full linear in episode length",
                "stream within 10% once compacting; full grows with length",
                f"stream {s[0]['peak KV entries']}..{max(g['peak KV entries'] for g in s)} entries; "
                f"full x{grow:.1f} for x{length:.1f} tokens",
                flat and grow >= 0.7 * length,
            )
        )


def _plots(ratios: list[dict], growth: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    points = [r for r in ratios if r["r/B"] is not None]
    if points:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        xs = [i / 100 for i in range(5, 96)]
        ax.plot(xs, [1 / (1 - x) for x in xs], "k--", lw=1, label="closed form B/(B-r) (tokens)")
        for model, marker in (("tiny", "o"), ("small", "s")):
            rows = [r for r in points if r["model"] == model]
            if rows:
                ax.scatter([r["r/B"] for r in rows], [r["wall reprefill/stream"] for r in rows], marker=marker,
                           s=50, label=f"{model}: wall-clock")  # fmt: skip
                ax.scatter([r["r/B"] for r in rows], [r["tokens reprefill/stream"] for r in rows],
                           marker=marker, s=50, facecolors="none", edgecolors="gray", label=f"{model}: tokens")  # fmt: skip
        ax.set_xlabel("retained fraction r/B")
        ax.set_ylabel("re-prefill / stream")
        ax.set_ylim(0.8, max(8.0, max(r["tokens reprefill/stream"] for r in points) * 1.1))
        ax.set_title("cost of re-prefill compaction relative to KV streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out / "rollout_speedup.png"))
    if growth:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for mode in ("stream", "full"):
            rows = [g for g in growth if g["mode"] == mode]
            ax.plot([g["trace tokens"] for g in rows], [g["peak KV entries"] for g in rows], "o-", label=mode)
        ax.set_xlabel("episode length (trace tokens)")
        ax.set_ylabel("peak live KV entries per sequence")
        ax.set_title("KV cache: stream compaction vs full context")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(save_figure(fig, out / "rollout_kv.png"))
    if len({r["turns"] for r in points}) > 1:
        paths.append(_curve_plot(points, out))
    return paths


def _curve_plot(points: list[dict], out: Path) -> str:
    """Wall-clock re-prefill/stream over episode length (one line per B) and over r/B (one line per length)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for b in sorted({r["B"] for r in points}):
        rows = sorted((r for r in points if r["B"] == b), key=lambda r: r["turns"])
        mean_rb = sum(r["r/B"] for r in rows) / len(rows)
        line = left.plot([r["turns"] for r in rows], [r["wall reprefill/stream"] for r in rows], "o-",
                         label=f"B = {b} (r/B ~{mean_rb:.2f}): wall-clock")[0]  # fmt: skip
        left.plot([r["turns"] for r in rows], [r["tokens reprefill/stream"] for r in rows], "--",
                  color=line.get_color(), alpha=0.6, label=f"B = {b}: tokens")  # fmt: skip
    for turns in sorted({r["turns"] for r in points}):
        rows = sorted((r for r in points if r["turns"] == turns), key=lambda r: r["r/B"])
        right.plot(
            [r["r/B"] for r in rows], [r["wall reprefill/stream"] for r in rows], "o-", label=f"{turns} turns"
        )
    left.set_xlabel("episode length (turns)")
    right.set_xlabel("retained fraction r/B")
    for ax in (left, right):
        ax.set_ylabel("re-prefill / stream")
        ax.axhline(3.0, color="gray", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"re-prefill vs KV streams ({points[0]['model']} model, {points[0]['env']}, {points[0]['strategy']})"
    )
    return save_figure(fig, out / "rollout_curve.png")

"""`kvstreams bench premise`: the Shadow Mask Distillation premise, measured on a real model.

SMD (seed 003, Sec. 1-3) rests on two claims: KV compression during rollouts removes information the
policy uses, and a dense learner then scores the replies under context the sampler never had (the
off-policy gap), while a learner replaying the sampler's mask does not. On the ``recall`` task (a
code stated early, asked at the end) with SmolLM2-135M-Instruct, greedy: the accuracy with the full
KV cache and with each eviction policy at SMD's compression rates (20/50/70% of each sequence's
entries dropped: budgets 0.8/0.5/0.3 of the tokens so far), and on the very same traces the gap of
the dense (naive) learner and of the shadow replay to the sampler.

The model must be converted first (``make real-model``); ``--quick`` runs the same code on the
tiny random model (accuracy 0: it only checks the command works).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstreams.bench.models import bench_model
from kvstreams.bench.report import BenchReport, Target, progress_bar, save_figure

EVICTING = ["h2o", "knorm", "random", "recent", "snapkv", "streaming_llm"]


@dataclass
class PremiseBenchSettings:
    model: str = "smollm2"
    episodes: int = 32
    batch: int = 16
    n_filler: int = 16
    rates: list[float] = field(default_factory=lambda: [0.2, 0.5, 0.7])  # shares of KV entries dropped
    policies: list[str] = field(default_factory=lambda: list(EVICTING))
    max_new_tokens: int = 16
    seed: int = 0

    @classmethod
    def preset(cls, quick: bool) -> PremiseBenchSettings:
        if quick:  # the command on the tiny random model: checks it works, accuracy is 0
            return cls(model="tiny", episodes=4, batch=4, rates=[0.5], policies=["snapkv", "recent"])
        return cls()

    def on_model(self, model: str) -> PremiseBenchSettings:
        return dataclasses.replace(self, model=model)


def _play(model, tok, chat, policy, settings: PremiseBenchSettings):
    """Greedy replies to the recall prompts with ``policy``: (traces, rewards)."""
    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.envs import make_env
    from kvstreams.single_turn import env_prompts, reply_reward

    engine = RolloutEngine(model, tok, policy)
    traces, rewards = [], []
    for start in range(0, settings.episodes, settings.batch):
        seeds = range(start, min(settings.episodes, start + settings.batch))
        envs = [make_env("recall", n_filler=settings.n_filler) for _ in seeds]
        prompts = env_prompts(chat, envs, seeds)
        params = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0, seed=settings.seed)
        batch = engine.generate(prompts, params)
        rewards += [reply_reward(env, chat, trace) for env, trace in zip(envs, batch, strict=True)]
        traces += batch
    return traces, rewards


def bench_premise(settings: PremiseBenchSettings, models_dir: str | Path, out_dir: str | Path) -> BenchReport:
    from kvstreams.chat import ChatFormat
    from kvstreams.models import load_model
    from kvstreams.policies import make_policy
    from kvstreams.replay import replay_logprobs
    from kvstreams.verify import Agreement

    started = time.perf_counter()
    report = BenchReport("premise", settings=dict(settings.__dict__))
    table = report.section(
        f"recall ({settings.episodes} prompts, greedy): accuracy and learner gaps on the same traces",
        (
            "policy",
            "dropped",
            "KV saving",
            "accuracy",
            "shadow max|Δ|",
            "dense max|Δ|",
            "dense mean|Δ|",
            "dense KL k3",
            "shadow KL k3",
        ),
        note="dropped: SMD's compression rate (share of each sequence's KV entries dropped); KV saving: measured "
        "(Trace.kv_saving); shadow: the learner replaying the record; dense: the naive learner",
    )
    model, tok = load_model(bench_model(settings.model, models_dir))
    chat = ChatFormat(tok)
    settings_list = [("full", 0.0)] + [(p, r) for r in settings.rates for p in settings.policies]
    with progress_bar(len(settings_list)) as step:
        for name, rate in settings_list:
            step(f"{name} {rate:.0%}")
            policy = make_policy(name) if name == "full" else make_policy(name, budget=round(1.0 - rate, 6))
            traces, rewards = _play(model, tok, chat, policy, settings)
            shadow = Agreement.measure(traces, replay_logprobs(model, traces, mode="shadow"))
            dense = Agreement.measure(traces, replay_logprobs(model, traces, mode="dense"))
            table.rows.append(
                {
                    "policy": name,
                    "dropped": rate,
                    "KV saving": sum(t.kv_saving() for t in traces) / len(traces),
                    "accuracy": sum(rewards) / len(rewards),
                    "shadow max|Δ|": shadow.max_abs_diff,
                    "dense max|Δ|": dense.max_abs_diff,
                    "dense mean|Δ|": dense.mean_abs_diff,
                    "dense KL k3": dense.kl_k3,
                    "shadow KL k3": shadow.kl_k3,
                }
            )
    _targets(report, table.rows)
    report.seconds = round(time.perf_counter() - started, 1)
    report.plots.append(_plot(table.rows, settings, Path(out_dir) / "premise.png"))
    return report


def _targets(report: BenchReport, rows: list[dict]) -> None:
    full = next(r for r in rows if r["policy"] == "full")
    compressed = [r for r in rows if r["policy"] != "full"]
    worst_shadow = max(r["shadow max|Δ|"] for r in compressed)
    report.targets += [
        Target(
            "the task is doable at full KV",
            "accuracy >= 0.9",
            f"{full['accuracy']:.2f}",
            full["accuracy"] >= 0.9,
        ),
        Target(
            "compression hurts some policy",
            "accuracy below full KV",
            f"lowest {min(r['accuracy'] for r in compressed):.2f}",
            min(r["accuracy"] for r in compressed) < full["accuracy"],
        ),
        Target("shadow replay exact", "max|Δ| <= 1e-4", f"worst {worst_shadow:.1e}", worst_shadow <= 1e-4),
        Target(
            "the dense learner is off wherever something was evicted",
            "dense KL k3 > 1e-6 (shadow's: ~1e-11)",
            f"smallest dense KL k3 {min(r['dense KL k3'] for r in compressed):.1e}",
            all(r["dense KL k3"] > 1e-6 for r in compressed),
        ),
    ]


def _plot(rows: list[dict], settings: PremiseBenchSettings, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, gap) = plt.subplots(1, 2, figsize=(11, 4))
    full = next(r for r in rows if r["policy"] == "full")
    for name in settings.policies:
        mine = sorted((r for r in rows if r["policy"] == name), key=lambda r: r["dropped"])
        xs = [0.0] + [r["dropped"] for r in mine]
        acc.plot(xs, [full["accuracy"]] + [r["accuracy"] for r in mine], marker="o", label=name)
        gap.plot(
            [r["dropped"] for r in mine], [r["dense KL k3"] for r in mine], marker="o", label=f"{name} dense"
        )
    rates = sorted({r["dropped"] for r in rows if r["policy"] != "full"})
    worst = [
        max(1e-16, *(r["shadow KL k3"] for r in rows if r["dropped"] == x and r["policy"] != "full"))
        for x in rates
    ]
    gap.plot(rates, worst, color="black", linestyle="--", marker="x", label="shadow, every policy (worst)")
    acc.set_title(f"recall accuracy, {settings.model}, greedy")
    acc.set_xlabel("share of KV entries dropped (SMD's compression rate)")
    acc.set_ylim(-0.05, 1.05)
    gap.set_title("learner vs sampler on the same traces")
    gap.set_xlabel("share of KV entries dropped")
    gap.set_ylabel("KL k3 (log)")
    gap.set_yscale("log")
    for ax in (acc, gap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)

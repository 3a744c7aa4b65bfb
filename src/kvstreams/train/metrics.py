"""Run metrics: JSONL per step (``metrics.jsonl``), TensorBoard event files, PNG plots at the end."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstreams.atomic import atomic_write
from kvstreams.errors import KVStreamsError

if TYPE_CHECKING:
    from kvstreams.train.config import Config
    from kvstreams.train.rollouts import RolloutBatch

PLOTS = {
    "reward.png": (
        "reward: training batches, and held-out pass@1 / pass@k / greedy",
        ["reward/mean", "eval/pass@1", "eval/pass@4", "eval/pass@8", "eval/reward_greedy"],
    ),
    "mismatch.png": (
        "sampler vs learner before the update (symlog)",
        ["mismatch/k3_kl", "mismatch/abs_logprob_diff_max"],
    ),
    "off_policy.png": ("token staleness", ["off_policy/token_staleness_mean", "off_policy/dropped_frac"]),
    "kv.png": ("KV cache", ["kv/peak_bytes"]),
    "tokens.png": (
        "tokens",
        ["tokens/forwarded", "tokens/trace", "tokens/reprefilled", "tokens/reprefill_equivalent"],
    ),
}


class MetricsLog:
    def __init__(self, out_dir: str | Path, tensorboard: bool = True, keep_until: int | None = None) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if keep_until is not None and self.path.exists():  # resuming: drop rows after the checkpoint
            rows = [r for r in self.read() if r["step"] <= keep_until]
            atomic_write(
                self.path, lambda tmp: Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in rows))
            )
        elif keep_until is None and self.path.exists():
            self.path.unlink()
        self.writer = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.writer = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:  # optional: metrics.jsonl and the plots carry the same figures
                self.writer = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, int | float)}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def read(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def plot(self) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.read()
        written = []
        for name, (title, keys) in PLOTS.items():
            fig, ax = plt.subplots(figsize=(6, 3.5))
            drawn = False
            for key in keys:
                points = [(r["step"], r[key], r.get(f"{key}_ci", 0.0)) for r in rows if key in r]
                if points:
                    xs, ys, half = zip(*points, strict=True)
                    if any(half):  # an evaluation: its 95% interval over tasks
                        ax.errorbar(
                            xs, ys, yerr=half, marker="o", markersize=4, capsize=3, label=f"{key} (95%)"
                        )
                    else:
                        line = ax.plot(xs, ys, marker="o", markersize=2, linewidth=0.8, alpha=0.5, label=key)[
                            0
                        ]
                        if key == "reward/mean" and len(ys) >= 8:  # the trend under the step-to-step noise
                            k = max(2, len(ys) // 8)
                            smooth = [
                                sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1])
                                for i in range(len(ys))
                            ]
                            ax.plot(
                                xs,
                                smooth,
                                color=line.get_color(),
                                linewidth=2,
                                label=f"{key}, mean of last {k}",
                            )
                    drawn = True
            if drawn:
                if "symlog" in title:  # the shadow track's ~1e-13 next to a baseline's ~1
                    ax.set_yscale("symlog", linthresh=1e-14)
                ax.set_title(title)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
                fig.tight_layout()
                path = self.dir / name
                fig.savefig(path, dpi=110)
                written.append(path)
            plt.close(fig)
        return written


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``. A last line cut off by a killed process is dropped with a
    warning; a bad line anywhere else is an error naming it."""
    if not path.exists():
        return []
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise KVStreamsError(f"{path}: line {number} is not JSON") from None
            print(f"kvstreams: {path}: dropped a cut-off last line", file=sys.stderr)
    return rows


def print_summary(cfg: Any, summary: dict[str, Any]) -> None:
    """The table ``kvstreams train`` ends with: held-out figures before and after RL, the replay's
    agreement with the sampler, and the tokens the rollouts forwarded."""
    from rich.table import Table

    from kvstreams.progress import console

    r = cfg.rollout
    table = Table(
        title=f"kvstreams train: {r.env}, {r.strategy or r.policy} ({r.mode}), correction {cfg.loss.type}"
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
    console().print(table)
    print(f"run directory: {cfg.train.out_dir} (metrics.jsonl, tensorboard/, *.png, checkpoints/)")


# --- a step's rollout figures and the run's summary ---------------------------------------------------
REPREFILL_EQUIVALENT = (
    "N + (N - N0) r / (B - r): N tokens forwarded, N0 before each episode's first compaction"
)


def rollout_metrics(batch: RolloutBatch, seconds: float) -> dict[str, float]:
    """A rollout batch's figures: reward, lengths, tokens forwarded and re-prefilled, KV peak, outcomes."""
    s = batch.stats
    sampled = sum(int(x.trace.sampled_mask.sum()) for x in batch.samples)
    episodes = max(1, len(batch.rewards))
    m = {
        "reward/mean": sum(batch.rewards) / episodes,
        "response/length_mean": sampled / episodes,
        "tokens/forwarded": float(s.tokens_forwarded),
        "tokens/reprefilled": float(s.tokens_reprefilled),
        "tokens/trace": float(s.tokens_trace),
        "kv/peak_bytes": float(s.kv_peak_bytes),
        "kv/peak_entries": float(s.kv_peak_entries),
        "kv/saving": sum(x.trace.kv_saving() for x in batch.samples) / max(1, len(batch.samples)),
        "rollout/compactions": float(s.compactions),
        "rollout/observations_truncated": float(s.observations_truncated),
        "rollout/seconds": seconds,
        "tokens/s": s.tokens_forwarded / max(seconds, 1e-9),
        **batch.outcome_means(),
    }
    # What the standard pipeline would have forwarded for the same rollouts, by the closed form in its
    # steady-state use (REPREFILL_EQUIVALENT): the first fill from 0 to B re-prefills nothing, and
    # leaving it out keeps the formula within 8% of counted re-prefills (docs/benchmarks.md).
    if s.compactions and s.retained_mean < s.context_at_compaction_mean:
        new = s.tokens_forwarded - s.tokens_reprefilled
        m["tokens/reprefill_equivalent"] = new + s.tokens_reprefilled_predicted_steady
    return m


def run_summary(
    cfg: Config, rows: list[dict[str, Any]], last: dict[str, float], first_eval: dict[str, float]
) -> dict[str, Any]:
    """``summary.json``: evaluation before and after, the last step's metrics, mismatch and tokens."""
    evals = [r for r in rows if "eval/reward_mean" in r]
    return {
        "steps": cfg.train.steps,
        "eval_before": evals[0] if evals else None,
        "eval_after": evals[-1] if len(evals) > 1 else None,
        "final": last,
        "first_eval": first_eval,
        "mismatch_k3_kl_mean": _mean(rows, "mismatch/k3_kl"),
        "mismatch_abs_logprob_diff_max": max(
            (r["mismatch/abs_logprob_diff_max"] for r in rows if "mismatch/abs_logprob_diff_max" in r),
            default=None,
        ),
        "tokens_forwarded": sum(r.get("tokens/forwarded", 0) for r in rows),
        "tokens_reprefill_equivalent": sum(
            r.get("tokens/reprefill_equivalent", r.get("tokens/forwarded", 0)) for r in rows
        ),
        "tokens_reprefill_equivalent_formula": REPREFILL_EQUIVALENT,
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None

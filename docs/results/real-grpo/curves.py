"""The figures of docs/results.md section 8 (GRPO on SmolLM2 under SnapKV, shadow vs naive), recomputed
from the stored runs: python docs/results/real-grpo/curves.py [RUNS_DIR]

Reads each arm's per-step log (metrics-ARM.jsonl.gz here, copied from the run's metrics.jsonl; or
RUNS_DIR/ARM/seed-0/metrics.jsonl of a run under way), the evaluations in results.json.gz when present,
and start_dense.json. Prints the table and writes docs/img/real_grpo.png.

Statistics: eval/pass@1 is the mean reward over 64 held-out tasks x 4 samples (T = 1; ± its 95%
interval over tasks, as logged); "train reward, steps a-b" is the mean over those steps of the batch's
mean reward (8 episodes a step); k3 KL and ESS are the per-step sampler-vs-learner figures
(mismatch/k3_kl, mismatch/ess), averaged over steps (ESS also its smallest step); "max abs log-ratio"
is the largest |log pi_learner - log pi_sampler| of any sampled token at any step; "first step" is the
first step whose train reward, averaged over it and the 9 before, reaches 0.9.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
ARMS = ("shadow", "naive")
PASS = "eval/pass@1"


def steps(arm: str, runs: Path | None) -> list[dict]:
    if runs is not None:
        text = (runs / arm / "seed-0" / "metrics.jsonl").read_text()
    else:
        text = gzip.decompress((HERE / f"metrics-{arm}.jsonl.gz").read_bytes()).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def evaluations() -> dict[str, dict]:
    path = HERE / "results.json.gz"
    if not path.is_file():
        return {}
    runs = json.loads(gzip.decompress(path.read_bytes()))["runs"]
    return {r["arm"]: r for r in runs}


def mean(rows: list[dict], key: str, lo: int = 1, hi: int = 10**9) -> float:
    values = [r[key] for r in rows if key in r and lo <= r["step"] <= hi]
    return sum(values) / len(values) if values else float("nan")


def first_step_at(rows: list[dict], level: float = 0.9, window: int = 10) -> int | None:
    """The first step whose mean train reward over the last ``window`` steps reaches ``level``."""
    reward = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    for i in range(window - 1, len(reward)):
        if sum(v for _, v in reward[i - window + 1 : i + 1]) / window >= level:
            return reward[i][0]
    return None


def extreme(rows: list[dict], key: str, pick) -> float:
    return pick(r[key] for r in rows if key in r)


def table(logs: dict[str, list[dict]], evals: dict[str, dict], dense_start: dict) -> str:
    out = [
        "| arm | steps | pass@1 before | pass@1 after | gain | greedy before -> after | dense pass@1 after "
        f"(start {dense_start[PASS]:.3f}) | train reward, steps 1-20 | 81-100 | first step, 10-step mean >= 0.9 "
        "| k3 KL | ESS (min) | max abs log-ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, rows in logs.items():
        run = evals.get(arm, {})
        start, final = run.get("start", {}), run.get("final", {})
        dense = run.get("evals", {}).get("dense", {})

        def iv(d: dict) -> str:
            return f"{d[PASS]:.3f} ± {d[PASS + '_ci']:.3f}" if PASS in d else "-"

        gain = f"{final[PASS] - start[PASS]:+.3f}" if PASS in final and PASS in start else "-"
        greedy = f"{start['eval/reward_greedy']:.3f} -> {final['eval/reward_greedy']:.3f}" if final else "-"
        out.append(
            f"| {arm} | {max(r['step'] for r in rows)} | {iv(start)} | {iv(final)} | {gain} | {greedy} | "
            f"{iv(dense)} | {mean(rows, 'reward/mean', 1, 20):.3f} | {mean(rows, 'reward/mean', 81, 100):.3f} "
            f"| {first_step_at(rows)} | {mean(rows, 'mismatch/k3_kl'):.2g} | {mean(rows, 'mismatch/ess'):.3f} "
            f"({extreme(rows, 'mismatch/ess', min):.3f}) | {extreme(rows, 'mismatch/abs_logprob_diff_max', max):.2g} |"
        )
    return "\n".join(out)


def plot(logs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for arm, rows in logs.items():
        xs = [r["step"] for r in rows if "reward/mean" in r]
        reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
        smooth = [
            sum(reward[max(0, i - 9) : i + 1]) / len(reward[max(0, i - 9) : i + 1])
            for i in range(len(reward))
        ]
        axes[0].plot(xs, smooth, label=arm)
        axes[1].semilogy(xs, [max(r["mismatch/k3_kl"], 1e-16) for r in rows if "reward/mean" in r], label=arm)
        axes[2].plot(xs, [r["mismatch/ess"] for r in rows if "reward/mean" in r], label=arm)
    axes[0].set(title="train reward (mean of the last 10 steps)", xlabel="step")
    axes[1].set(title="sampler vs learner k3 KL per token", xlabel="step")
    axes[2].set(title="ESS of the per-token weights", xlabel="step", ylim=(0, 1.05))
    for ax in axes:
        ax.legend()
    fig.suptitle("GRPO on SmolLM2-135M, recall, SnapKV 20% dropped (one seed per arm)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(runs: Path | None) -> None:
    logs = {arm: steps(arm, runs) for arm in ARMS}
    dense_start = json.loads((HERE / "start_dense.json").read_text())["0"]
    print(table(logs, evaluations(), dense_start))
    plot(logs, HERE.parents[1] / "img" / "real_grpo.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)

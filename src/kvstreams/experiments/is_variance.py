"""``is-variance``: the variance of the sequence-level importance weight grows with length under the
naive learner and is 0 under the shadow replay (SMD, Theorem 1).

The sampler draws a reply of ``L`` tokens under KV compression; a learner that scores it has the
sequence weight w = prod_t pi_learner(y_t) / pi_sampler(y_t). The naive learner sees the dense
context, so log w is a sum of L per-token log-ratios whose variance grows with L (SMD Thm. 1: the
variance of w grows exponentially in the accumulated per-token divergence); the shadow learner
replays the sampler's visibility, so w = 1 up to float rounding. One long reply per prompt gives
every shorter length as its prefix (compression decisions up to token L do not depend on what
comes after), so each length is measured on the same rollouts.

Replicates are seeds: a seeded tiny model per seed (and, when converted, SmolLM2-135M with a
different sampling seed per replicate); figures are mean ± 95% interval over them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvstreams.chat import ChatFormat
from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.envs import make_env
from kvstreams.experiments.spec import ExperimentSpec
from kvstreams.policies import make_policy
from kvstreams.replay import replay_logprobs
from kvstreams.single_turn import env_prompts
from kvstreams.stats import mean_interval
from kvstreams.trace import Trace


def sequence_log_weights(traces: list[Trace], learner: list[torch.Tensor], length: int) -> torch.Tensor:
    """log w per trace over its first ``length`` sampled tokens (traces shorter than that: NaN)."""
    out = []
    for trace, lp in zip(traces, learner, strict=True):
        sampled = trace.sampled_mask.nonzero().flatten()[:length]
        if len(sampled) < length:
            out.append(float("nan"))
            continue
        diff = lp[sampled].double() - trace.sampler_logprobs[sampled].double()
        out.append(float(diff.sum()))
    return torch.tensor(out, dtype=torch.float64)


def weight_figures(log_w: torch.Tensor) -> dict[str, float]:
    """Var(w), Var(log w) and the effective sample size fraction (sum w)^2 / (n sum w^2)."""
    log_w = log_w[~torch.isnan(log_w)]
    w = log_w.exp()
    return {
        "var_w": float(w.var()),
        "var_log_w": float(log_w.var()),
        "ess_frac": float(w.sum() ** 2 / (len(w) * (w**2).sum())),
        "n": len(w),
    }


def probe_model(model, tokenizer, spec: ExperimentSpec, seed: int, quick: bool) -> dict[str, Any]:
    """The figures per length and learner for one model and sampling seed."""
    base = spec.base.get("rollout", {})
    policy = make_policy(base.get("policy", "snapkv"), **base.get("policy_args", {}))
    chat = ChatFormat(tokenizer)
    n = 4 if quick else spec.probe.episodes
    lengths = spec.probe.lengths[:2] if quick else spec.probe.lengths
    envs = [make_env(base.get("env", "recall"), **base.get("env_args", {})) for _ in range(n)]
    prompts = env_prompts(chat, envs, [10_000 * seed + i for i in range(n)])
    params = SamplingParams(max_new_tokens=max(lengths), temperature=1.0, stop_token_ids=(), seed=seed)
    traces = RolloutEngine(model, tokenizer, policy).generate(prompts, params)
    out: dict[str, Any] = {}
    for learner in ("dense", "shadow"):
        lps = replay_logprobs(model, traces, mode=learner, backend="sdpa")
        out[learner] = {str(L): weight_figures(sequence_log_weights(traces, lps, L)) for L in lengths}
    out["kv_saving"] = sum(t.kv_saving() for t in traces) / len(traces)
    return out


def summarise_probe(replicates: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean ± interval over replicates, per learner, length and figure."""
    summary: dict[str, Any] = {}
    for learner in ("dense", "shadow"):
        summary[learner] = {}
        for length in replicates[0][learner]:
            figures = replicates[0][learner][length]
            summary[learner][length] = {
                key: mean_interval([r[learner][length][key] for r in replicates]).as_dict()
                for key in figures
                if key != "n"
            }
    return summary


def plot_probe(summaries: dict[str, dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in ((axes[0], "var_log_w", "Var(log w)"), (axes[1], "var_w", "Var(w)")):
        for model_name, summary in summaries.items():
            for learner, style in (("dense", "-o"), ("shadow", "--s")):
                lengths = sorted(summary[learner], key=int)
                ys = [max(summary[learner][L][key]["mean"], 1e-30) for L in lengths]
                ax.plot([int(L) for L in lengths], ys, style, markersize=3, label=f"{model_name}, {learner}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("reply length (tokens)")
        ax.set_title(f"{title} of the sequence importance weight")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "is_variance.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Sampler/learner mismatch metrics, in the vocabulary of verl's rollout correction and slime.

Inputs are the log-probs of the sampled tokens under the sampler (the behaviour policy, recorded in
the trace) and under the learner *before any update* (in the view the correction trains with:
shadow replay, dense, or re-prefill segments), with the sequence each token belongs to. Tokens were
sampled from the sampler, so every expectation below is over the sampler's distribution.

Definitions follow verl (``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_offpolicy_metrics``,
``compute_is_metrics``) with rho = pi_learner / pi_sampler per token:

| key | definition |
|---|---|
| ``mismatch/kl`` | mean(lp_sampler - lp_learner): the k1 estimator of KL(sampler || learner); may be < 0 |
| ``mismatch/k3_kl`` | mean(rho - 1 - log rho): the k3 estimator of the same KL, >= 0 per token |
| ``mismatch/chi2_token`` | mean(rho^2) - 1 |
| ``mismatch/chi2_seq`` | mean over sequences of (prod rho)^2 - 1, the sum of log rho clamped to +-20 |
| ``mismatch/log_ppl_diff`` | mean over sequences of (mean lp_sampler - mean lp_learner) = log PPL_learner - log PPL_sampler |
| ``mismatch/log_ppl_abs_diff`` | the same with the absolute value per sequence |
| ``mismatch/is_weight_mean``, ``_std``, ``_min``, ``_max`` | statistics of rho, before any truncation |
| ``mismatch/ess`` | (sum rho)^2 / (N sum rho^2), in (0, 1]: 1 when every weight is equal |
| ``mismatch/abs_logprob_diff_mean``, ``_max`` | mean and max of abs(lp_learner - lp_sampler) |
| ``mismatch/tokens`` | N, the tokens these figures are over |

Token-level figures pool all tokens of the batch (longer sequences weigh more), sequence-level ones
average per sequence first, as verl does. Where we differ: log-ratios are clamped to +-20 before
``exp`` in *every* figure (verl leaves ``kl``/``k3_kl`` unclamped), so one catastrophic token cannot
make the figures infinite; and the statistics of rho are over the unclamped weights' values within
that bound (verl clamps the ESS weights to [1/C, C] with its truncation threshold C; we have none).
"""

from __future__ import annotations

import torch

LOG_RATIO_BOUND = 20.0


def mismatch_metrics(
    learner_logp: torch.Tensor, sampler_logp: torch.Tensor, seq: torch.Tensor
) -> dict[str, float]:
    """The table above for per-token log-probs [N] and sequence ids [N] (any integers)."""
    n = learner_logp.numel()
    if n == 0:
        return {"mismatch/tokens": 0.0}
    lp_l, lp_s = learner_logp.double(), sampler_logp.double()
    log_rho = (lp_l - lp_s).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = log_rho.exp()
    _, seq_index = torch.unique(seq, return_inverse=True)
    n_seq = int(seq_index.max()) + 1
    count = torch.zeros(n_seq, dtype=torch.float64).index_add(0, seq_index, torch.ones_like(lp_l))
    per_seq_log_rho = torch.zeros(n_seq, dtype=torch.float64).index_add(0, seq_index, log_rho)
    mean_diff = torch.zeros(n_seq, dtype=torch.float64).index_add(0, seq_index, lp_s - lp_l) / count
    seq_rho_sq = (2 * per_seq_log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).exp()
    abs_diff = (lp_l - lp_s).abs()
    return {
        "mismatch/kl": float((-log_rho).mean()),
        "mismatch/k3_kl": float((rho - 1 - log_rho).mean()),
        "mismatch/chi2_token": float((rho * rho).mean() - 1),
        "mismatch/chi2_seq": float(seq_rho_sq.mean() - 1),
        "mismatch/log_ppl_diff": float(mean_diff.mean()),
        "mismatch/log_ppl_abs_diff": float(mean_diff.abs().mean()),
        "mismatch/is_weight_mean": float(rho.mean()),
        "mismatch/is_weight_std": float(rho.std(unbiased=False)),
        "mismatch/is_weight_min": float(rho.min()),
        "mismatch/is_weight_max": float(rho.max()),
        "mismatch/ess": float(rho.sum() ** 2 / (n * (rho * rho).sum())),
        "mismatch/abs_logprob_diff_mean": float(abs_diff.mean()),
        "mismatch/abs_logprob_diff_max": float(abs_diff.max()),
        "mismatch/tokens": float(n),
    }

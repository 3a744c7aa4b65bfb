"""Sparse-RL: rejection sampling plus importance reweighting of the dense learner (Luo et al., 2026).

Luo et al., "Sparse-RL: Breaking the Memory Wall in LLM Reinforcement Learning via Stable Sparse
Rollouts" (arXiv 2601.10079; SMD cites it as Luo et al., 2024). Two variants, because the paper that
compares against it and the released code disagree:

``sparse_rl``: as SMD describes it (seed 003, Sec. 4.1): "rejection sampling (discarding the 20% most
deviated rollout trajectories) and importance weighting (rho clipped to [0.8, 1.2])". SMD defines
neither the deviation nor the weights' granularity; we take a sequence's deviation to be its mean
|log pi_old - log pi_sampler| and the weight per token, rho = pi_old / pi_sampler clamped to
[0.8, 1.2], with pi_old the dense learner before the update.

``sparse_rl_released``: what ``lsjia/Sparse-RL`` runs (slime's
``examples/train_infer_mismatch_helper/mis.py`` with its ``mis.yaml``): per token
rho = exp(clamp(log pi_old - log pi_sampler, +-20)); weight min(rho, 1.5) divided by its mean
(``tis_batch_normalize``); a token is kept only if 0.5 <= rho <= 1.5; a sequence is vetoed whole if
any of its tokens has rho < 1e-4; PPO clip 0.2 on both sides. Where we differ: the weights' mean is
over the whole batch's tokens (rejected ones included, as there), not per micro-batch, so the result
does not depend on how the batch is split; and with ``aggregation = "sequence"`` fully vetoed
sequences leave the sequence count (slime keeps them in it; verl drops them, as we do).

In both, rejected tokens and sequences leave the policy-gradient term, the loss normaliser, and the
KL and entropy terms, as in the released code.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from kvstreams.train.corrections.base import Behaviour, LossBase, Weighting, register
from kvstreams.train.corrections.tis import truncated_weights
from kvstreams.train.mismatch import LOG_RATIO_BOUND


def sequence_mean(values: torch.Tensor, seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """[n_seqs] mean of per-token ``values`` within each sequence (0 where a sequence has none)."""
    sums = torch.zeros(n_seqs, dtype=values.dtype).index_add(0, seq, values)
    counts = torch.zeros(n_seqs, dtype=values.dtype).index_add(0, seq, torch.ones_like(values))
    return sums / counts.clamp(min=1)


def reject_most_deviated(deviation: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep mask [S] dropping the ``fraction`` of sequences with the largest deviation."""
    n_drop = int(fraction * deviation.numel())
    keep = torch.ones_like(deviation, dtype=torch.bool)
    if n_drop:
        keep[deviation.argsort(descending=True, stable=True)[:n_drop]] = False
    return keep


@register("sparse_rl", view="dense", needs_start_logp=True)
class SparseRLLoss(LossBase):
    type: Literal["sparse_rl"] = "sparse_rl"
    reject_fraction: float = Field(
        0.2, ge=0, lt=1, description="share of sequences dropped, most deviated first"
    )
    weight_low: float = Field(0.8, gt=0, description="rho below it is raised to it")
    weight_high: float = Field(1.2, gt=0, description="rho above it is lowered to it")

    @model_validator(mode="after")
    def _bounds(self) -> SparseRLLoss:
        if self.weight_low > self.weight_high:
            raise ValueError("weight_low must not exceed weight_high")
        return self

    def weigh(self, b: Behaviour) -> Weighting:
        assert b.start_logp is not None
        deviation = sequence_mean((b.start_logp - b.sampler_logp).abs(), b.seq, b.n_seqs)
        keep_seq = reject_most_deviated(deviation, self.reject_fraction)
        return Weighting(
            old_logp=b.start_logp,
            weight=truncated_weights(b.start_logp, b.sampler_logp, self.weight_low, self.weight_high),
            keep=keep_seq[b.seq],
        )


@register("sparse_rl_released", view="dense", needs_start_logp=True)
class SparseRLReleasedLoss(LossBase):
    type: Literal["sparse_rl_released"] = "sparse_rl_released"
    clip_high: float = Field(
        0.2, ge=0, description="PPO clip: ratio <= 1 + clip_high (released: eps_clip 0.2)"
    )
    weight_cap: float = Field(
        1.5, gt=0, description="importance weights are truncated to it (tis_upper_bound)"
    )
    batch_normalize: bool = Field(
        True, description="divide the weights by their batch mean (tis_batch_normalize)"
    )
    reject_low: float = Field(0.5, ge=0, description="tokens with rho below it are rejected")
    reject_high: float = Field(1.5, gt=0, description="tokens with rho above it are rejected")
    veto_threshold: float = Field(
        1e-4, ge=0, description="a token with rho below it vetoes its whole sequence"
    )

    @model_validator(mode="after")
    def _bounds(self) -> SparseRLReleasedLoss:
        if self.reject_low > self.reject_high:
            raise ValueError("reject_low must not exceed reject_high")
        return self

    def weigh(self, b: Behaviour) -> Weighting:
        assert b.start_logp is not None
        log_rho = (b.start_logp - b.sampler_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        rho = log_rho.exp()
        weight = rho.clamp(max=self.weight_cap)
        if self.batch_normalize and weight.numel():
            weight = weight / weight.mean()
        in_band = (rho >= self.reject_low) & (rho <= self.reject_high)
        catastrophic = (
            b.start_logp - b.sampler_logp < math.log(self.veto_threshold) if self.veto_threshold else None
        )
        vetoed = torch.zeros(b.n_seqs, dtype=torch.bool)
        if catastrophic is not None:
            vetoed = vetoed.index_put((b.seq[catastrophic],), torch.tensor(True))
        return Weighting(
            old_logp=b.start_logp,
            weight=weight.detach(),
            keep=in_band & ~vetoed[b.seq],
            metrics={
                "correction/band_rejected_token_frac": float((~in_band).float().mean())
                if rho.numel()
                else 0.0,
                "correction/vetoed_seq_frac": float(vetoed.float().mean()) if b.n_seqs else 0.0,
            },
        )

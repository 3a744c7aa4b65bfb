"""TIS: truncated importance sampling of the dense learner against the sampler, per token.

Yao et al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training": the
learner's pi_old (its own no-grad forward before the update) differs from the sampler's pi, so each
token's policy-gradient term is multiplied by w = min(pi_old / pi_sampler, C), detached; verl's
rollout correction calls it token-level IS with ``rollout_is_threshold`` C = 2. Here the learner is
dense and the sampler's cache was compressed, so w corrects the compression mismatch (SMD's
"importance reweighting", Table 1, in its practical truncated form).

Defaults: cap C = 2 (Yao et al.; verl), no lower truncation (``floor`` = 0).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from kvstreams.train.corrections.base import Behaviour, LossBase, Weighting, all_kept, register


def truncated_weights(start_logp: torch.Tensor, sampler_logp: torch.Tensor, low: float, high: float):
    """pi_learner / pi_sampler per token, clamped to [low, high], detached."""
    return torch.exp(start_logp - sampler_logp).clamp(low, high).detach()


@register("tis", view="dense", needs_start_logp=True)
class TISLoss(LossBase):
    type: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=0, description="C: weights above it are truncated to it")
    floor: float = Field(0.0, ge=0, description="weights below it are raised to it (0: none)")

    @model_validator(mode="after")
    def _bounds(self) -> TISLoss:
        if self.floor > self.cap:
            raise ValueError("floor must not exceed cap")
        return self

    def weigh(self, b: Behaviour) -> Weighting:
        assert b.start_logp is not None
        weight = truncated_weights(b.start_logp, b.sampler_logp, self.floor, self.cap)
        raw = torch.exp(b.start_logp - b.sampler_logp)
        return Weighting(
            old_logp=b.start_logp,
            weight=weight,
            keep=all_kept(b),
            metrics={
                "correction/truncated_frac": float(((raw > self.cap) | (raw < self.floor)).float().mean())
            },
        )

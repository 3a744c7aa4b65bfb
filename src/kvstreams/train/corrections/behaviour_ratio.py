"""Behaviour ratio: the dense learner with the sampler's recorded log-prob as pi_old.

Not a baseline of either paper: what a framework does when it reuses the inference engine's
log-probs as the PPO "old" log-probs (prime-rl computes its importance ratio against the inference
log-probs) while the learner attends densely. The PPO ratio pi_dense / pi_sampler then starts away
from 1, and the PPO clip acts as a one-sided truncated importance weight: a token whose ratio has
left [1 - clip_low, 1 + clip_high] in its advantage's direction gets no gradient. So it partly
corrects the mismatch, unlike ``naive`` (ratio 1, nothing corrected). kvstreams' ``naive`` was
this until the fidelity review; it is kept under this name for comparison.
"""

from __future__ import annotations

from typing import Literal

from kvstreams.train.corrections.base import Behaviour, LossBase, Weighting, all_kept, register, unit_weight


@register("behaviour_ratio", view="dense", needs_start_logp=False)
class BehaviourRatioLoss(LossBase):
    type: Literal["behaviour_ratio"] = "behaviour_ratio"

    def weigh(self, b: Behaviour) -> Weighting:
        return Weighting(old_logp=b.sampler_logp, weight=unit_weight(b), keep=all_kept(b))

"""Shadow: the learner replays the sampler's recorded visibility (Shadow Mask Distillation; KV-streams).

SMD (seed 003, Sec. 3.2-3.4 and Algorithm 1): the learner's attention is masked with the shadow mask
the sampler recorded, per layer and KV head, so pi_theta(y | x, M) reproduces pi_sparse and the PPO
ratio is 1 at the first update; the reference policy of the KL term is evaluated under the same mask.
Track 2 adds lambda * KL(sg[pi_dense] || pi_shadow), summed over the vocabulary at every trained
position, with the dense teacher recomputed in every update epoch (Algorithm 1, lines 19-21).
KV-streams trains its compacted episodes the same way: one trace, the deleted spans masked.

Where we differ: pi_old is the sampler's recorded log-prob rather than a no-grad shadow forward at
step start. The two are equal up to float error on synchronous rollouts (measured as
``mismatch/*``); on asynchronous rollouts the recorded one is the true behaviour policy of stale
tokens, so the same ratio also corrects staleness.

Defaults: lambda = 0.1 (the paper's setting).

``distill_scaling = "advantaged"`` is ours, not SMD's: lambda is multiplied by the batch's share of
traces with a non-zero advantage. GRPO groups whose rewards are all equal give no policy gradient
but full distillation, so on a saturated batch the distillation alone moves the weights: the cause
docs/results.md (section 4, ``distill-collapse``) gives for lambda 0.1 collapsing a small policy.
Scaling keeps the two tracks' ratio where the policy gradient acts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvstreams.train.corrections.base import Behaviour, LossBase, Weighting, all_kept, register, unit_weight


@register("shadow", view="shadow", needs_start_logp=False)
class ShadowLoss(LossBase):
    type: Literal["shadow"] = "shadow"
    distill_coef: float = Field(
        0.1, ge=0, description="lambda of SMD's dense-to-shadow KL track (0: shadow alignment only)"
    )
    distill_scaling: Literal["constant", "advantaged"] = Field(
        "constant",
        description="constant: lambda as given (SMD); advantaged: lambda x the batch's share of traces "
        "with a non-zero advantage (logged as loss/distill_scale), so saturated GRPO groups, which "
        "give no policy gradient, give no distillation either",
    )

    def weigh(self, b: Behaviour) -> Weighting:
        return Weighting(old_logp=b.sampler_logp, weight=unit_weight(b), keep=all_kept(b))

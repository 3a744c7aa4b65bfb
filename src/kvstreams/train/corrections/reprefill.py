"""Re-prefill: each compaction segment is its own sample (KV-streams' standard-pipeline baseline).

KV-streams (seed 000): without in-place eviction, every compaction ends the trace and a new one
starts from the retained tokens, prefilled again with reset positions; the trainer then sees one
sample per segment, each with plain causal attention (nothing is evicted inside a segment). The
segments' log-probs equal the sampler's, so pi_old is the recorded log-prob and the ratio is 1.
"""

from __future__ import annotations

from typing import Literal

from kvstreams.train.corrections.base import Behaviour, LossBase, Weighting, all_kept, register, unit_weight


@register("reprefill", view="segments", needs_start_logp=False)
class RePrefillLoss(LossBase):
    type: Literal["reprefill"] = "reprefill"

    def weigh(self, b: Behaviour) -> Weighting:
        return Weighting(old_logp=b.sampler_logp, weight=unit_weight(b), keep=all_kept(b))

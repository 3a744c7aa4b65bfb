"""Naive: the dense learner, as if no KV had been evicted (SMD's "GRPO w/ SnapKV" baseline).

SMD (seed 003, Sec. 1 and Table 4/6): rollouts are sampled with a compressed KV cache, and the
learner recomputes every log-prob with full dense attention, pi_old included. So the PPO ratio is 1
at the first update and nothing corrects the mismatch between pi_sparse (which sampled) and
pi_dense (which is trained): the paper's collapse from 74.5 to 64.3 on GSM8K. KV-streams' re-prefill
pipeline trains compacted episodes the same way when they are scored as one full trace.

pi_old is the learner's own dense log-prob before the first update (one no-grad forward).
"""

from __future__ import annotations

from typing import Literal

from kvstreams.train.corrections.base import Behaviour, LossBase, Weighting, all_kept, register, unit_weight


@register("naive", view="dense", needs_start_logp=True)
class NaiveLoss(LossBase):
    type: Literal["naive"] = "naive"

    def weigh(self, b: Behaviour) -> Weighting:
        assert b.start_logp is not None
        return Weighting(old_logp=b.start_logp, weight=unit_weight(b), keep=all_kept(b))

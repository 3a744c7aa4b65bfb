"""Rollout corrections, one module each, registered by name (``[loss] type = ...``).

| type | the learner sees | pi_old | weight | keeps |
|---|---|---|---|---|
| ``shadow`` | the recorded visibility | sampler | 1 (+ SMD distillation) | all |
| ``naive`` | dense | learner (dense) before the update | 1 | all |
| ``behaviour_ratio`` | dense | sampler | 1 (the PPO clip truncates) | all |
| ``tis`` | dense | learner (dense) before the update | min(rho, 2) | all |
| ``sparse_rl`` | dense | learner (dense) before the update | clamp(rho, 0.8, 1.2) | 80% least deviated sequences |
| ``sparse_rl_released`` | dense | learner (dense) before the update | min(rho, 1.5) / mean | 0.5 <= rho <= 1.5, no veto |
| ``reprefill`` | each re-prefill segment | sampler | 1 | all |

rho = pi_old / pi_sampler per token.
"""

from kvstreams.train.corrections import behaviour_ratio, naive, reprefill, shadow, sparse_rl, tis  # noqa: F401
from kvstreams.train.corrections.base import CORRECTIONS, Behaviour, LossBase, Weighting, register
from kvstreams.train.corrections.behaviour_ratio import BehaviourRatioLoss
from kvstreams.train.corrections.naive import NaiveLoss
from kvstreams.train.corrections.reprefill import RePrefillLoss
from kvstreams.train.corrections.shadow import ShadowLoss
from kvstreams.train.corrections.sparse_rl import SparseRLLoss, SparseRLReleasedLoss
from kvstreams.train.corrections.tis import TISLoss

__all__ = [
    "CORRECTIONS",
    "Behaviour",
    "BehaviourRatioLoss",
    "LossBase",
    "NaiveLoss",
    "RePrefillLoss",
    "ShadowLoss",
    "SparseRLLoss",
    "SparseRLReleasedLoss",
    "TISLoss",
    "Weighting",
    "register",
]

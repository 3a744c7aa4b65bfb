"""Learner replay: log-probs of traces under their recorded visibility (shadow) or causal (dense)."""

from kvstreams.replay.masks import block_mask_from_death
from kvstreams.replay.replay import (
    BACKENDS,
    REPLAY_MODES,
    ReplayBatch,
    ReplayMask,
    collate,
    predicting_rows,
    replay_logits,
    replay_logprobs,
    token_logprobs,
)

__all__ = [
    "BACKENDS",
    "REPLAY_MODES",
    "ReplayBatch",
    "ReplayMask",
    "block_mask_from_death",
    "collate",
    "predicting_rows",
    "replay_logits",
    "replay_logprobs",
    "token_logprobs",
]

"""The rollout-correction interface and registry.

A correction answers one question for the learner: *given what the sampler recorded and what the
learner computes before updating, how is each sampled token trained?* It says which attention the
learner replays (``view``), whether it needs the learner's log-probs before the first update
(``needs_start_logp``), and implements one function from :class:`Behaviour` to :class:`Weighting`:
the PPO ratio's denominator pi_old, a per-token weight, a keep mask (rejected tokens leave the loss,
its normaliser, and the KL and entropy terms) and its own metrics. Adding one is one file::

    @register("my_correction", view="dense", needs_start_logp=True)
    class MyCorrection(LossBase):
        '''Which paper, what it does, its defaults.'''
        type: Literal["my_correction"] = "my_correction"

        def weigh(self, b: Behaviour) -> Weighting:
            return Weighting(old_logp=b.start_logp, weight=torch.ones_like(b.sampler_logp),
                             keep=torch.ones_like(b.sampler_logp, dtype=torch.bool))

The configuration class *is* the correction: its fields are the ``[loss]`` section of the TOML
(``type`` picks the variant), with the PPO/GRPO fields every correction shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

View = Literal["shadow", "dense", "segments"]


@dataclass(frozen=True)
class Behaviour:
    """Per sampled token of the whole batch [N] (micro-batches concatenated in order)."""

    sampler_logp: torch.Tensor  # recorded by the sampler: the behaviour policy
    start_logp: torch.Tensor | None  # the learner's, in the correction's view, before any update
    seq: torch.Tensor  # sequence index in the batch
    n_seqs: int


@dataclass
class Weighting:
    """How each token [N] enters the loss."""

    old_logp: torch.Tensor  # pi_old: the PPO ratio is pi_theta / pi_old
    weight: torch.Tensor  # multiplies the token's policy-gradient term (detached)
    keep: torch.Tensor  # bool: False leaves the loss, its normaliser, KL and entropy terms
    metrics: dict[str, float] = field(default_factory=dict)


class LossBase(BaseModel):
    """PPO/GRPO settings shared by every correction (``[loss]`` in the TOML)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    #: set by :func:`register`
    view: ClassVar[View] = "dense"
    needs_start_logp: ClassVar[bool] = False

    type: str = Field(description="the correction (kvstreams.train.corrections.CORRECTIONS)")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip: ratio >= 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="PPO clip: ratio <= 1 + clip_high (clip-higher, DAPO)")
    aggregation: Literal["token", "sequence"] = Field(
        "token", description="token: mean over the batch's kept tokens; sequence: mean of per-sequence means"
    )
    normalize_std: bool = Field(True, description="divide advantages by the group's std; false: Dr. GRPO")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the frozen reference, in the correction's view")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus")

    def weigh(self, b: Behaviour) -> Weighting:
        raise NotImplementedError


CORRECTIONS: dict[str, type[LossBase]] = {}


def register(name: str, view: View, needs_start_logp: bool) -> Callable[[type[LossBase]], type[LossBase]]:
    """Class decorator: make the correction available as ``[loss] type = name``."""

    def wrap(cls: type[LossBase]) -> type[LossBase]:
        cls.view = view
        cls.needs_start_logp = needs_start_logp
        CORRECTIONS[name] = cls
        return cls

    return wrap


def all_kept(b: Behaviour) -> torch.Tensor:
    return torch.ones_like(b.sampler_logp, dtype=torch.bool)


def unit_weight(b: Behaviour) -> torch.Tensor:
    return torch.ones_like(b.sampler_logp)

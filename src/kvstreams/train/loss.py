"""The learner's objective as one function, :func:`objective` (``LossInputs -> LossOutputs``, prime-rl's
shape), and its terms as plain functions of tensors (each unit-tested against hand values).

Shapes: per-token tensors are [N] over the trained tokens of a micro-batch (flattened), with
``seq`` [N] saying which sequence each token belongs to when sequence-level aggregation needs it.
The learner keeps the forward and the backward; the correction (``train/corrections``) has decided
pi_old, the weight and which tokens are kept before any of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO: reward minus its group's mean, divided by the group's std unless ``normalize_std`` is off
    (Dr. GRPO). ``rewards`` [G * group_size], groups contiguous. ``valid`` [G * group_size] bool:
    episodes left out (failed ones): they neither count in their group's statistics nor get an
    advantage (0)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size).float()
    w = torch.ones_like(r) if valid is None else valid.view(-1, group_size).float()
    n = w.sum(dim=1, keepdim=True).clamp(min=1)
    mean = (r * w).sum(dim=1, keepdim=True) / n
    adv = (r - mean) * w
    if normalize_std:
        std = ((adv**2).sum(dim=1, keepdim=True) / n).sqrt()
        adv = adv / (std + eps)
    return adv.reshape(-1)


def ppo_clip_loss(
    logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clipped policy-gradient loss with separate low/high clip (clip-higher, DAPO).

    Returns (loss [N], ratio [N], clipped [N] bool: the clip decided the gradient)."""
    ratio = torch.exp(logp - logp_old)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, ratio.detach(), (clipped < unclipped).detach()


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) on samples from pi: r - 1 - log r, r = pi_ref / pi."""
    log_r = logp_ref - logp
    return torch.exp(log_r) - 1.0 - log_r


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def distillation_kl(teacher_logp: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(teacher || student) summed over the vocabulary. ``teacher_logp`` is detached
    (stop-gradient: the dense teacher is the same weights and must not be pulled toward the student)."""
    student_logp = torch.log_softmax(student_logits.float(), dim=-1)
    teacher_logp = teacher_logp.detach()
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(dim=-1)


def aggregate(
    per_token: torch.Tensor, seq: torch.Tensor, keep: torch.Tensor, mode: str, n_tokens: int, n_seqs: int
) -> torch.Tensor:
    """Only kept tokens count. Token level: their sum / ``n_tokens`` (the whole batch's kept tokens, so
    micro-batches add up exactly). Sequence level: each sequence's mean over its kept tokens, summed,
    / ``n_seqs`` (the whole batch's sequences with a kept token)."""
    kept = torch.where(keep, per_token, torch.zeros_like(per_token))
    if mode == "token":
        return kept.sum() / max(n_tokens, 1)
    if mode == "sequence":
        _, index = torch.unique(seq, return_inverse=True)
        n = int(index.max()) + 1 if index.numel() else 0
        sums = torch.zeros(n, device=per_token.device, dtype=kept.dtype).index_add(0, index, kept)
        counts = torch.zeros(n, device=per_token.device, dtype=kept.dtype).index_add(
            0, index, keep.to(kept.dtype)
        )
        return (sums[counts > 0] / counts[counts > 0]).sum() / max(n_seqs, 1)
    raise ValueError(f"unknown aggregation {mode!r}")


@dataclass
class Normaliser:
    """What the loss is divided by: the whole batch's kept tokens, or its sequences with a kept token,
    so that micro-batches add up exactly to the full-batch loss."""

    tokens: int
    seqs: int
    mode: str

    def __call__(self, per_token: torch.Tensor, seq: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return aggregate(per_token, seq, keep, self.mode, self.tokens, self.seqs)


@dataclass(frozen=True)
class Coefficients:
    """The ``[loss]`` numbers the objective reads (from any correction's config: :meth:`of`; only the
    shadow correction has a ``distill_coef``)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    distill_coef: float = 0.0  # SMD's track B; only the shadow correction sets it

    @classmethod
    def of(cls, loss, distill_scale: float = 1.0) -> Coefficients:
        """``distill_scale``: the factor on lambda (the shadow correction's ``distill_scaling``)."""
        distill = getattr(loss, "distill_coef", 0.0) * distill_scale
        return cls(loss.clip_low, loss.clip_high, loss.entropy_coef, loss.kl_coef, distill)


@dataclass
class LossInputs:
    """One micro-batch's trained tokens, [N] each unless said."""

    logp: torch.Tensor  # log pi(token) under the current weights, with grad
    old_logp: torch.Tensor  # the correction's pi_old
    advantages: torch.Tensor
    weight: torch.Tensor  # the correction's per-token weight (detached)
    keep: torch.Tensor  # bool: False leaves the loss, its normaliser, KL and entropy
    seq: torch.Tensor  # the sequence each token belongs to
    norm: Normaliser
    logits: torch.Tensor  # [N, V] the current policy's logits, divided by the sampling temperature
    ref_logp: torch.Tensor | None = None  # the frozen reference's log-probs (KL term)
    teacher_logp: torch.Tensor | None = None  # [N, V] SMD's dense teacher, log-softmaxed, no grad


@dataclass
class LossOutputs:
    total: torch.Tensor  # the scalar to backpropagate
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # normalised terms, detached
    ratio: torch.Tensor | None = None  # [N] pi / pi_old, detached
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # total's parts with their
    # coefficients, with grad ("pg", "entropy", "kl", "distill"): train.term_grad_norms backpropagates
    # them one at a time


def objective(x: LossInputs, c: Coefficients) -> LossOutputs:
    """PPO-clipped policy gradient x the correction's weight, minus the entropy bonus, plus the k3 KL to
    the reference and SMD's distillation KL(teacher || policy), each normalised by ``x.norm`` over
    the kept tokens. No PPO ratio is skipped when on policy: with pi_old = the sampler, the ratio is
    1 up to float error and the clip never fires."""
    pg, ratio, clipped = ppo_clip_loss(x.logp, x.old_logp, x.advantages, c.clip_low, c.clip_high)
    total = x.norm(pg * x.weight, x.seq, x.keep)
    out = LossOutputs(total, {"loss/pg": total.detach()}, ratio, {"pg": total})
    entropy = x.norm(entropy_from_logits(x.logits), x.seq, x.keep)
    out.metrics["entropy/mean"] = entropy.detach()
    if c.entropy_coef > 0:
        out.terms["entropy"] = -c.entropy_coef * entropy
    if x.ref_logp is not None:
        kl = x.norm(kl_k3(x.logp, x.ref_logp), x.seq, x.keep)
        out.metrics["loss/kl"] = kl.detach()
        out.terms["kl"] = c.kl_coef * kl
    if x.teacher_logp is not None:
        distill = x.norm(distillation_kl(x.teacher_logp, x.logits), x.seq, x.keep)
        out.metrics["loss/distill"] = distill.detach()
        out.terms["distill"] = c.distill_coef * distill
    out.metrics["clip/frac"] = x.norm(clipped.float(), x.seq, x.keep).detach()
    out.metrics["ratio/mean"] = x.norm(ratio, x.seq, x.keep).detach()
    out.total = sum(out.terms.values())  # pg first, then the others in the order above
    return out

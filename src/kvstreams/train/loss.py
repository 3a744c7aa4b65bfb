"""Loss terms of the learner, as plain functions of tensors (each unit-tested against hand values).

Shapes: per-token tensors are [N] over the sampled tokens of a micro-batch (flattened), with
``seq`` [N] saying which sequence each token belongs to when sequence-level aggregation needs it.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: reward minus its group's mean, divided by the group's std unless ``normalize_std`` is off
    (Dr. GRPO). ``rewards`` [G * group_size], groups contiguous."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size).float()
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
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


def truncated_importance_weights(
    logp_learner: torch.Tensor, logp_sampler: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Per-token pi_learner / pi_sampler clipped to [low, high], detached (TIS; Sparse-RL's weights)."""
    return torch.exp(logp_learner - logp_sampler).clamp(low, high).detach()


def reject_most_deviated(deviation: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep mask [S] dropping the ``fraction`` of sequences with the largest deviation (Sparse-RL's
    sparsity-aware rejection sampling)."""
    n_drop = int(fraction * deviation.numel())
    keep = torch.ones_like(deviation, dtype=torch.bool)
    if n_drop:
        keep[deviation.argsort(descending=True)[:n_drop]] = False
    return keep


def aggregate(
    per_token: torch.Tensor, seq: torch.Tensor, n_seqs: int, mode: str, total_tokens: int
) -> torch.Tensor:
    """Token level: sum / ``total_tokens`` (the whole batch's, so micro-batches add up exactly).
    Sequence level: each sequence's mean, summed, / ``n_seqs`` (the whole batch's)."""
    if mode == "token":
        return per_token.sum() / max(total_tokens, 1)
    if mode == "sequence":
        sums = torch.zeros(int(seq.max()) + 1 if seq.numel() else 1, device=per_token.device).index_add(
            0, seq, per_token
        )
        counts = torch.zeros_like(sums).index_add(0, seq, torch.ones_like(per_token))
        return (sums[counts > 0] / counts[counts > 0]).sum() / max(n_seqs, 1)
    raise ValueError(f"unknown aggregation {mode!r}")

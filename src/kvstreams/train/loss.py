"""Loss terms of the learner, as plain functions of tensors (each unit-tested against hand values).

Shapes: per-token tensors are [N] over the sampled tokens of a micro-batch (flattened), with
``seq`` [N] saying which sequence each token belongs to when sequence-level aggregation needs it.
"""

from __future__ import annotations

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

"""From a rollout batch to what the learner trains on: advantages, staleness, trained positions.

Runs before the learner and changes nothing in the batch. Versions: the learner's step s trains the
weights of version s (version 0 is the starting model; step s publishes version s + 1), and every
sampled token records the version that sampled it, so a token's staleness at step s is s - version.

Off-policy bound, as prime-rl defines it (``max_off_policy_steps``; its orchestrator stamps each group
with the version it was dispatched under and drops episodes whose staleness exceeds the bound): a
group whose *oldest* sampled token is more than ``max_off_policy_steps`` versions behind the step
that trains it is dropped whole. Where we differ: we know every token's version, so the age is
measured from the oldest token actually sampled, not from the dispatch.
"""

from __future__ import annotations

import torch

from kvstreams.train.learner import TrainItem, trained_positions
from kvstreams.train.loss import group_advantages
from kvstreams.train.rollouts import RolloutBatch, Sample


def sampled_versions(sample: Sample) -> torch.Tensor:
    """[n sampled tokens] the weights version that sampled each token (-1 if the trace has none)."""
    t = sample.trace
    if t.weights_version is None:
        return torch.full((int(t.sampled_mask.sum()),), -1, dtype=torch.long)
    return t.weights_version[t.sampled_mask].long()


def stale_groups(
    batch: RolloutBatch, step: int, max_off_policy_steps: int
) -> tuple[set[int], dict[str, float]]:
    """Groups to drop at ``step`` and the staleness figures (token distribution, episodes, drops)."""
    versions = [sampled_versions(s) for s in batch.samples]
    known = [v[v >= 0] for v in versions]
    tokens = torch.cat(known) if known else torch.zeros(0, dtype=torch.long)
    oldest: dict[int, int] = {}  # group -> oldest version of its sampled tokens
    for s, v in zip(batch.samples, known, strict=True):
        if v.numel():
            oldest[s.group] = min(oldest.get(s.group, step), int(v.min()))
    stale = {g for g, v in oldest.items() if step - v > max_off_policy_steps}
    metrics: dict[str, float] = {}
    if tokens.numel():
        staleness = step - tokens
        metrics["off_policy/token_staleness_mean"] = float(staleness.float().mean())
        metrics["off_policy/token_staleness_max"] = float(staleness.max())
        for k in range(max_off_policy_steps + 1):
            metrics[f"off_policy/token_frac_{k}"] = float((staleness == k).float().mean())
        metrics["off_policy/token_frac_over"] = float((staleness > max_off_policy_steps).float().mean())
        metrics["rollout/version_min"] = float(tokens.min())
        metrics["rollout/version_max"] = float(tokens.max())
    groups = {s.group for s in batch.samples}
    metrics["off_policy/group_staleness_max"] = float(max((step - v for v in oldest.values()), default=0))
    metrics["off_policy/dropped_frac"] = len(stale) / max(1, len(groups))
    metrics["off_policy/dropped_tokens"] = float(
        sum(int(v.numel()) for s, v in zip(batch.samples, versions, strict=True) if s.group in stale)
    )
    return stale, metrics


def zero_variance_groups(rewards: torch.Tensor, group_size: int, valid: torch.Tensor) -> torch.Tensor:
    """[G] bool: the groups whose valid episodes all earned the same reward. GRPO gives every episode
    of such a group a zero advantage, so the group carries no policy gradient (DAPO, Yu et al. 2025,
    Sec. 3.2: "the gradients will be zero"); a group with fewer than two valid episodes counts too."""
    r = rewards.view(-1, group_size).float()
    v = valid.view(-1, group_size)
    high = torch.where(v, r, torch.full_like(r, -torch.inf)).amax(dim=1)
    low = torch.where(v, r, torch.full_like(r, torch.inf)).amin(dim=1)
    return (v.sum(dim=1) < 2) | (high == low)


def learner_items(
    batch: RolloutBatch,
    step: int,
    group_size: int,
    normalize_std: bool,
    max_off_policy_steps: int,
    drop_zero_variance: bool = False,
) -> tuple[list[TrainItem], dict[str, float]]:
    """GRPO advantages per episode (reward minus its group's mean, / std unless Dr. GRPO), given to
    every trained token of the episode (all its segments in re-prefill mode); stale groups and
    episodes whose environment raised are dropped, and with ``drop_zero_variance`` the groups whose
    rewards are all equal (DAPO's dynamic sampling, filter only: ``train.zero_variance_groups``)."""
    failed = batch.failed()
    valid = torch.tensor([not f for f in failed])
    rewards = torch.tensor(batch.rewards)
    advantages = group_advantages(rewards, group_size, normalize_std, valid=valid)
    stale, metrics = stale_groups(batch, step, max_off_policy_steps)
    flat = zero_variance_groups(rewards, group_size, valid)
    metrics["rollout/zero_variance_group_frac"] = float(flat.float().mean())
    dropped = set(stale)
    if drop_zero_variance:
        dropped |= {g for g in range(len(flat)) if flat[g]}
    # an episode whose environment raised is not trained on: its reward says nothing about the policy
    items = [
        TrainItem(s.trace, float(advantages[s.episode]), trained_positions(s.trace))
        for s in batch.samples
        if s.group not in dropped and not failed[s.episode]
    ]
    metrics["rollout/failed_frac"] = sum(failed) / max(1, len(failed))
    return items, metrics

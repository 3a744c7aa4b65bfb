"""The learner: one GRPO step on a rollout batch, replaying each trace's recorded visibility.

Follow one sampled token: its trace is packed into a micro-batch (``collate``), the same HF model
runs over it with the visibility the sampler had (``replay_logits``, shadow track), the token's
log-prob enters the PPO-clipped loss against the behaviour policy (the sampler's recorded log-prob),
and for SMD a dense forward of the same micro-batch (no grad) is the teacher of a KL term. The
corrections differ only in which visibility the learner uses and how the ratio is weighted:

| correction | learner sees | pi_old | weight |
|---|---|---|---|
| shadow | recorded (death) | sampler | 1 (+ SMD distillation) |
| naive | dense causal | sampler | 1 (off-policy ignored) |
| tis | dense causal | learner dense at step start | clip(pi_dense / pi_sampler, 0.8, 1.2) |
| sparse_rl | dense causal | learner dense at step start | as tis, after rejecting the 20% most deviated |
| reprefill | each segment (no eviction inside) | sampler | 1 |
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstreams.models import model_shape
from kvstreams.replay import collate, replay_logits
from kvstreams.train import loss as L
from kvstreams.train.config import Config
from kvstreams.train.rollouts import RolloutBatch, Sample


@dataclass
class MicroBatch:
    samples: list[Sample]
    positions: list[torch.Tensor]  # per sample, trained token positions (t >= 1)
    n_tokens: int


def trained_positions(sample: Sample) -> torch.Tensor:
    t = sample.trace
    return (t.loss_mask & t.sampled_mask).nonzero().squeeze(-1)


def micro_batches(samples: Sequence[Sample], max_tokens: int) -> list[MicroBatch]:
    """Greedy packing in order: each micro-batch holds up to ``max_tokens`` trace tokens."""
    out: list[MicroBatch] = []
    current: list[Sample] = []
    size = 0
    for s in samples:
        n = len(s.trace)
        if current and size + n > max_tokens:
            out.append(_mb(current))
            current, size = [], 0
        current.append(s)
        size += n
    if current:
        out.append(_mb(current))
    return out


def _mb(samples: list[Sample]) -> MicroBatch:
    positions = [trained_positions(s) for s in samples]
    return MicroBatch(samples, positions, sum(int(p.numel()) for p in positions))


class Learner:
    def __init__(self, model, cfg: Config, reference=None) -> None:
        self.model = model
        self.cfg = cfg
        self.reference = reference
        self.shape = model_shape(model)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _lr_factor(self, step: int) -> float:
        o, total = self.cfg.optim, self.cfg.train.steps * self.cfg.optim.updates_per_batch
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        if o.schedule == "linear":
            return 1.0 - progress
        if o.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(progress * math.pi))
        return 1.0

    @property
    def learner_mode(self) -> str:
        return "dense" if self.cfg.loss.correction in ("naive", "tis", "sparse_rl") else "shadow"

    # --- forwards ------------------------------------------------------------------------------------
    def _logits(self, model, mb: MicroBatch, mode: str):
        batch = collate(
            [s.trace for s in mb.samples],
            self.shape.n_layers,
            self.shape.n_kv_heads,
            mode=mode,
            packed=self.cfg.optim.packed,
        )
        return replay_logits(model, batch, self.cfg.train.backend), batch

    def _gather(
        self, logits: torch.Tensor, batch, mb: MicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``logits`` predicting each trained token, the tokens, and their sample index."""
        rows, targets, seq = [], [], []
        for k, ((row, start, _), pos) in enumerate(zip(batch.spans, mb.positions, strict=True)):
            rows.append(logits[row, start + pos - 1])
            targets.append(batch.tokens[row, start + pos].to(logits.device))
            seq.append(torch.full((pos.numel(),), k, dtype=torch.long, device=logits.device))
        return torch.cat(rows), torch.cat(targets), torch.cat(seq)

    def _token_logp(self, rows: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        return torch.log_softmax(rows.float() / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

    # --- one step ---------------------------------------------------------------------------------
    def step(self, batch: RolloutBatch) -> dict[str, float]:
        cfg, lc = self.cfg, self.cfg.loss
        device = next(self.model.parameters()).device
        rewards = torch.tensor(batch.rewards)
        adv = L.group_advantages(rewards, cfg.rollout.group_size, lc.normalize_std)
        for s in batch.samples:
            s.advantage = float(adv[s.episode])
        samples = [s for s in batch.samples if trained_positions(s).numel() > 0]
        metrics: dict[str, float] = {}
        temperature = samples[0].trace.temperature if samples else 1.0

        # --- behaviour policy, learner-at-start, reference, teacher (no grad) ---------------------
        mbs = micro_batches(samples, cfg.optim.micro_batch_tokens)
        old, ref, teacher = [], [], []
        first_logp: list[tuple[torch.Tensor, torch.Tensor]] = []  # (learner before updating, sampler)
        weighted = lc.correction in ("tis", "sparse_rl")
        with torch.no_grad():
            for mb in mbs:
                sampler = torch.cat(
                    [s.trace.sampler_logprobs[p] for s, p in zip(mb.samples, mb.positions, strict=True)]
                )
                if weighted:  # pi_old is the learner itself: one forward before any update
                    logits, packed = self._logits(self.model, mb, self.learner_mode)
                    rows, targets, _ = self._gather(logits, packed, mb)
                    start_logp = self._token_logp(rows, targets, temperature).cpu()
                    first_logp.append((start_logp, sampler))
                    weights = L.truncated_importance_weights(start_logp, sampler, lc.tis_low, lc.tis_high)
                    old.append((start_logp, weights))
                    del logits
                else:  # pi_old is the behaviour policy; the first update's forward gives the mismatch
                    old.append((sampler, torch.ones_like(sampler)))
                if lc.kl_coef > 0 and self.reference is not None:
                    rl, rp = self._logits(self.reference, mb, self.learner_mode)
                    rrows, rtargets, _ = self._gather(rl, rp, mb)
                    ref.append(self._token_logp(rrows, rtargets, temperature).cpu())
                if lc.distill_coef > 0 and self.learner_mode == "shadow" and lc.correction == "shadow":
                    dl, dp = self._logits(self.model, mb, "dense")
                    drows, _, _ = self._gather(dl, dp, mb)
                    teacher.append(torch.log_softmax(drows.float() / temperature, dim=-1))

        # --- Sparse-RL: reject the most deviated rollouts -----------------------------------------
        keep_samples = torch.ones(len(samples), dtype=torch.bool)
        if lc.correction == "sparse_rl" and samples:
            deviation = []
            for (lp, sp), mb in zip(first_logp, mbs, strict=True):
                k = 0
                for p in mb.positions:
                    n = p.numel()
                    deviation.append(float((lp[k : k + n] - sp[k : k + n]).abs().mean()))
                    k += n
            keep_samples = L.reject_most_deviated(torch.tensor(deviation), lc.reject_fraction)
        metrics["rollout/discarded_frac"] = float(1 - keep_samples.float().mean()) if samples else 0.0

        total_tokens = sum(mb.n_tokens for mb in mbs)
        n_seqs = len(samples)
        sums = {"loss/pg": 0.0, "loss/kl": 0.0, "loss/distill": 0.0, "entropy/mean": 0.0, "clip/frac": 0.0}
        ratio_dev = 0.0
        ratio_mean = 0.0
        self.model.train()
        for update in range(cfg.optim.updates_per_batch):
            sample_index = 0
            for i, mb in enumerate(mbs):
                keep_tok = torch.cat(
                    [
                        torch.full((p.numel(),), bool(keep_samples[sample_index + j]))
                        for j, p in enumerate(mb.positions)
                    ]
                ).to(device)
                sample_index += len(mb.samples)
                logits, packed = self._logits(self.model, mb, self.learner_mode)
                rows, targets, seq = self._gather(logits, packed, mb)
                logp = self._token_logp(rows, targets, temperature)
                old_lp, weight = (t.to(device) for t in old[i])
                if update == 0 and not weighted:
                    first_logp.append((logp.detach().cpu(), old[i][0]))
                advantages = torch.cat(
                    [
                        torch.full((p.numel(),), s.advantage)
                        for s, p in zip(mb.samples, mb.positions, strict=True)
                    ]
                ).to(device)
                pg, ratio, clipped = L.ppo_clip_loss(logp, old_lp, advantages, lc.clip_low, lc.clip_high)
                pg = pg * weight * keep_tok
                total = L.aggregate(pg, seq, n_seqs, lc.aggregation, total_tokens)
                sums["loss/pg"] += float(total.detach())
                ent = L.entropy_from_logits(rows)
                sums["entropy/mean"] += float(ent.detach().sum()) / max(total_tokens, 1)
                if lc.entropy_coef > 0:
                    total = total - lc.entropy_coef * L.aggregate(
                        ent, seq, n_seqs, lc.aggregation, total_tokens
                    )
                if ref:
                    kl = L.kl_k3(logp, ref[i].to(device))
                    kl_term = L.aggregate(kl, seq, n_seqs, lc.aggregation, total_tokens)
                    sums["loss/kl"] += float(kl_term.detach())
                    total = total + lc.kl_coef * kl_term
                if teacher:
                    distill = L.distillation_kl(teacher[i].to(device), rows / temperature)
                    distill_term = L.aggregate(distill, seq, n_seqs, lc.aggregation, total_tokens)
                    sums["loss/distill"] += float(distill_term.detach())
                    total = total + lc.distill_coef * distill_term
                total.backward()
                sums["clip/frac"] += float(clipped.float().sum()) / max(total_tokens, 1)
                if update == 0:
                    ratio_dev = max(ratio_dev, float((ratio - 1).abs().max()) if ratio.numel() else 0.0)
                    ratio_mean += float(ratio.sum()) / max(total_tokens, 1)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        # mismatch between sampler and learner before any update (the shadow track's claim: ~0)
        learner_lp = torch.cat([a for a, _ in first_logp]) if first_logp else torch.zeros(0)
        sampler_lp = torch.cat([b for _, b in first_logp]) if first_logp else torch.zeros(0)
        d = (learner_lp - sampler_lp).double()
        metrics["mismatch/kl"] = float((d.exp() - 1 - d).mean()) if d.numel() else 0.0
        metrics["mismatch/abs_logprob_diff_max"] = float(d.abs().max()) if d.numel() else 0.0
        updates = cfg.optim.updates_per_batch
        metrics.update({k: v / updates for k, v in sums.items()})
        metrics["ratio/first_update_max_abs_dev"] = ratio_dev
        metrics["ratio/first_update_mean"] = ratio_mean
        metrics["grad/norm"] = float(grad_norm)
        metrics["optim/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["tokens/trained"] = float(total_tokens)
        return metrics

"""The learner: one GRPO step on a batch of traces, replaying what the sampler saw.

Follow one sampled token. Its trace is laid out in a micro-batch (``collate``) and the same HF model
runs over it with the attention its correction asks for (``replay_logits``: the recorded visibility
for ``shadow``, dense causal for the baselines, each segment for ``reprefill``). The token's log-prob
under the distribution it was sampled from (temperature, top-k/top-p: ``policy_logprobs``) enters
the PPO-clipped loss; the correction (``kvstreams.train.corrections``) has decided, once per step
and before any update, its pi_old, its weight and whether it is kept. Kept tokens alone count in
the loss, its normaliser and the KL and entropy terms. For SMD, a dense no-grad forward of the same
micro-batch, recomputed in every update epoch, is the teacher of a distillation KL.

``step`` is: before the update (no grad: pi_old, reference) -> correction -> for each update epoch,
for each micro-batch: forward -> loss -> backward -> optimizer step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstreams.errors import KVStreamsError
from kvstreams.models import model_shape
from kvstreams.replay import collate, predicting_rows, replay_logits
from kvstreams.sampling import policy_logprobs
from kvstreams.trace import Trace
from kvstreams.train import loss as losses
from kvstreams.train.config import Config
from kvstreams.train.corrections import Behaviour, Weighting
from kvstreams.train.mismatch import mismatch_metrics

REPLAY_MODE = {"shadow": "shadow", "dense": "dense", "segments": "shadow"}  # a segment evicts nothing


def trained_positions(trace: Trace) -> torch.Tensor:
    """Positions of the tokens the loss trains on: sampled by the model and in the loss mask."""
    return (trace.loss_mask & trace.sampled_mask).nonzero().squeeze(-1)


@dataclass(frozen=True)
class TrainItem:
    """One trace to train on, with its advantage and the positions of its trained tokens (t >= 1)."""

    trace: Trace
    advantage: float
    positions: torch.Tensor


@dataclass
class MicroBatch:
    items: list[TrainItem]
    first_seq: int  # index of items[0] in the whole batch

    @property
    def n_tokens(self) -> int:
        return sum(int(i.positions.numel()) for i in self.items)

    def per_token(self, values: Sequence[float]) -> torch.Tensor:
        """[N] one value per item, repeated over its trained tokens."""
        return torch.cat(
            [torch.full((i.positions.numel(),), float(v)) for i, v in zip(self.items, values, strict=True)]
        )

    def seq(self) -> torch.Tensor:
        """[N] each trained token's sequence index in the whole batch."""
        return self.per_token(range(self.first_seq, self.first_seq + len(self.items))).long()

    def sampler_logp(self) -> torch.Tensor:
        return torch.cat([i.trace.sampler_logprobs[i.positions] for i in self.items])


def micro_batches(items: Sequence[TrainItem], max_tokens: int) -> list[MicroBatch]:
    """Greedy packing in order: each micro-batch holds up to ``max_tokens`` trace tokens."""
    out: list[MicroBatch] = []
    current: list[TrainItem] = []
    size, first = 0, 0
    for item in items:
        n = len(item.trace)
        if current and size + n > max_tokens:
            out.append(MicroBatch(current, first))
            first += len(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        out.append(MicroBatch(current, first))
    return out


class SingleProcess:
    """The learner's view of data parallelism when it runs alone: every micro-batch is its own and
    nothing needs combining. :class:`kvstreams.cluster.fsdp.FSDPGroup` is the same interface over
    FSDP2 ranks."""

    def assign(self, n: int) -> list[tuple[int, bool]]:
        """The micro-batches (index, real) this process runs; a False one is a stand-in that keeps the
        ranks' collectives in step and trains nothing."""
        return [(i, True) for i in range(n)]

    def gather(self, parts: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every rank's per-micro-batch tensors, by micro-batch index."""
        return parts

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        """The metric sums of every rank added up (maxima for ``*_max_abs_dev``), as a new dict."""
        return dict(sums)

    def all(self, flag: bool) -> bool:
        return flag


class Learner:
    def __init__(self, model, cfg: Config, reference=None, group: SingleProcess | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.group = group or SingleProcess()
        self.loss = cfg.loss
        self.reference = reference
        self.shape = model_shape(model)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.distill_scale = 1.0  # the factor on SMD's lambda this step (loss.distill_scaling)
        # train.term_grad_norms: each loss term's gradient, summed over an update's micro-batches
        self.term_grads: dict[str, list[torch.Tensor | None]] | None = (
            {} if cfg.train.term_grad_norms else None
        )

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

    def gather(self, optimizer: bool = False) -> None:
        """Nothing to gather: this process holds the weights and optimizer state itself
        (:class:`kvstreams.cluster.fsdp.LearnerGroup` gathers its ranks')."""

    def weights_finite(self) -> bool:
        """Whether every parameter is finite (a finite gradient times a huge lr can still break them)."""
        return self.group.all(all(bool(torch.isfinite(_local(p)).all()) for p in self.model.parameters()))

    # --- forwards ------------------------------------------------------------------------------------
    def _rows(self, model, mb: MicroBatch, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits rows predicting each trained token [N, V], and the tokens [N]."""
        batch = collate(
            [i.trace for i in mb.items],
            self.shape.n_layers,
            self.shape.n_kv_heads,
            mode=mode,
            packed=self.cfg.optim.packed,
        )
        logits = replay_logits(model, batch, self.cfg.train.backend)
        return predicting_rows(logits, batch, [i.positions for i in mb.items])

    def _logp(self, rows: torch.Tensor, targets: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """log pi(token) [N] under each trace's sampling distribution (temperature, top-k, top-p),
        one call per run of traces sampled alike (usually the whole micro-batch)."""
        out, k = [], 0
        for params, run in itertools.groupby(
            mb.items, key=lambda i: (i.trace.temperature, i.trace.top_k, i.trace.top_p)
        ):
            n = sum(int(i.positions.numel()) for i in run)
            out.append(policy_logprobs(rows[k : k + n], targets[k : k + n], *params))
            k += n
        return torch.cat(out)

    def _temperatures(self, mb: MicroBatch) -> torch.Tensor:
        return mb.per_token([i.trace.temperature for i in mb.items])

    @torch.no_grad()
    def _before_update(
        self, mbs: list[MicroBatch], mine: list[tuple[int, bool]]
    ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor | None]]:
        """No-grad passes before any update: the learner's log-probs in the correction's view (when the
        correction needs them as pi_old: every rank's, gathered in batch order) and the reference's
        (for the KL term), per micro-batch this process runs."""
        mode = REPLAY_MODE[self.loss.view]
        start: dict[int, torch.Tensor] = {}
        ref: dict[int, torch.Tensor | None] = {}
        for i, real in mine:
            if self.loss.needs_start_logp:
                logp = self._logp(*self._rows(self.model, mbs[i], mode), mbs[i]).cpu()
                if real:
                    start[i] = logp
            ref[i] = None
            if self.loss.kl_coef > 0 and self.reference is not None:
                ref[i] = self._logp(*self._rows(self.reference, mbs[i], mode), mbs[i]).cpu()
        if not self.loss.needs_start_logp:
            return None, ref
        start = self.group.gather(start)
        return torch.cat([start[i] for i in range(len(mbs))]), ref

    # --- one step ---------------------------------------------------------------------------------
    def step(self, items: Sequence[TrainItem]) -> dict[str, float]:
        """One GRPO step (``optim.updates_per_batch`` optimizer steps) on ``items``; returns metrics."""
        items = [i for i in items if i.positions.numel() > 0]
        if not items:
            return {"tokens/trained": 0.0, "optim/skipped": 1.0, "optim/nonfinite_skipped": 0.0}
        mbs = micro_batches(items, self.cfg.optim.micro_batch_tokens)
        mine = self.group.assign(len(mbs))
        advantaged = getattr(self.loss, "distill_scaling", "constant") == "advantaged"
        if advantaged:
            self.distill_scale = sum(i.advantage != 0 for i in items) / len(items)
        start_logp, ref = self._before_update(mbs, mine)
        sampler_logp = torch.cat([mb.sampler_logp() for mb in mbs])
        seq = torch.cat([mb.seq() for mb in mbs])
        weighting = self.loss.weigh(Behaviour(sampler_logp, start_logp, seq, len(items)))
        norm = losses.Normaliser(
            tokens=int(weighting.keep.sum()),
            seqs=int(seq[weighting.keep].unique().numel()),
            mode=self.loss.aggregation,
        )
        parts = _split(weighting, [mb.n_tokens for mb in mbs])
        sums, grad_norm, skipped, first_logp = self._updates(mbs, mine, parts, ref, norm)
        self.model.eval()
        # the mismatch the correction faces: sampler vs the learner, in its view, before any update
        if start_logp is None:
            first_logp = self.group.gather(first_logp)
        learner_logp = (
            start_logp if start_logp is not None else torch.cat([first_logp[i] for i in range(len(mbs))])
        )
        metrics = mismatch_metrics(learner_logp, sampler_logp, seq)
        metrics.update(weighting.metrics)
        updates = self.cfg.optim.updates_per_batch
        metrics.update({k: v / (updates if not k.startswith("ratio/") else 1) for k, v in sums.items()})
        metrics["correction/kept_token_frac"] = norm.tokens / max(1, seq.numel())
        metrics["correction/discarded_seq_frac"] = 1 - norm.seqs / len(items)
        metrics["grad/norm"] = grad_norm
        if advantaged:
            metrics["loss/distill_scale"] = self.distill_scale
        metrics["optim/nonfinite_skipped"] = float(skipped)
        metrics["optim/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["tokens/trained"] = float(norm.tokens)
        return metrics

    def _updates(
        self, mbs, mine, parts, ref, norm
    ) -> tuple[dict[str, float], float, int, dict[int, torch.Tensor]]:
        """``optim.updates_per_batch`` optimizer steps over this process's micro-batches; returns every
        rank's metric sums, the last gradient norm, the updates skipped and the first update's
        log-probs (every rank's, by micro-batch)."""
        sums: dict[str, float] = {}  # this process's share; `totals` holds every rank's
        totals: dict[str, float] = {}
        first_logp: dict[int, torch.Tensor] = {}
        self.model.train()
        skipped, grad_norm = 0, 0.0
        for update in range(self.cfg.optim.updates_per_batch):
            losses_before = totals
            for i, real in mine:
                # a stand-in keeps no token: it runs forward and backward only to match the ranks'
                # collectives, and adds zero to every sum and gradient
                part = parts[i] if real else _nothing_kept(parts[i])
                logp = self._accumulate(mbs[i], part, ref[i], norm, sums, first=update == 0)
                if update == 0 and real:
                    first_logp[i] = logp
            self._add_term_grad_norms(sums)
            grad_norm = _value(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            )
            totals = self.group.reduce(sums)
            # a non-finite loss or gradient never reaches the weights: the update is skipped and counted
            finite = math.isfinite(grad_norm) and all(
                math.isfinite(v - losses_before.get(k, 0.0))
                for k, v in totals.items()
                if k.startswith("loss/")
            )
            if finite:
                self.optimizer.step()
                self.scheduler.step()
            else:
                skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        return totals, grad_norm, skipped, first_logp

    def _accumulate(
        self,
        mb: MicroBatch,
        w: Weighting,
        ref: torch.Tensor | None,
        norm: losses.Normaliser,
        sums: dict,
        first: bool,
    ) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; returns its log-probs (detached, CPU)."""
        device = next(self.model.parameters()).device
        temperatures = self._temperatures(mb).to(device)[:, None]
        teacher = None
        coefs = losses.Coefficients.of(self.loss, self.distill_scale)
        if coefs.distill_coef > 0:  # SMD track B: the dense teacher with the current weights, no grad
            with torch.no_grad():
                rows, _ = self._rows(self.model, mb, "dense")
                teacher = torch.log_softmax(rows.float() / temperatures, dim=-1)
                del rows
        rows, targets = self._rows(self.model, mb, REPLAY_MODE[self.loss.view])
        logp = self._logp(rows, targets, mb)
        keep = w.keep.to(device)
        out = losses.objective(
            losses.LossInputs(
                logp=logp,
                old_logp=w.old_logp.to(device),
                advantages=mb.per_token([i.advantage for i in mb.items]).to(device),
                weight=w.weight.to(device),
                keep=keep,
                seq=mb.seq().to(device),
                norm=norm,
                logits=rows / temperatures,
                ref_logp=None if ref is None else ref.to(device),
                teacher_logp=teacher,
            ),
            coefs,
        )
        if self.term_grads is None:
            out.total.backward()
        else:
            self._backward_by_term(out.terms)
        for key, value in out.metrics.items():
            if key == "ratio/mean":  # only the first update's ratio says anything (pi_old = pi there)
                if first:
                    _add(sums, "ratio/first_update_mean", value)
            else:
                _add(sums, key, value)
        if first:
            dev = float((out.ratio - 1)[keep].abs().max()) if bool(keep.any()) else 0.0
            sums["ratio/first_update_max_abs_dev"] = max(sums.get("ratio/first_update_max_abs_dev", 0.0), dev)
        return logp.detach().cpu()

    def _backward_by_term(self, terms: dict[str, torch.Tensor]) -> None:
        """``total.backward()`` one term at a time: each term's gradient goes into ``.grad`` (their sum
        is the update's) and into its own accumulator (``train.term_grad_norms``)."""
        assert self.term_grads is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        names = [name for name, term in terms.items() if term.requires_grad]
        for j, name in enumerate(names):
            grads = torch.autograd.grad(
                terms[name], params, retain_graph=j < len(names) - 1, allow_unused=True
            )
            acc = self.term_grads.setdefault(name, [None] * len(params))
            for k, (p, g) in enumerate(zip(params, grads, strict=True)):
                if g is None:
                    continue
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)
                acc[k] = g if acc[k] is None else acc[k].add_(g)

    def _add_term_grad_norms(self, sums: dict[str, float]) -> None:
        """Each term's gradient norm over this update (``grad/NAME_norm``, added to ``sums``, which the
        step divides by the updates: the mean over updates); the accumulators start again."""
        if self.term_grads is None:
            return
        for name, acc in self.term_grads.items():
            squares = sum(float(g.double().pow(2).sum()) for g in acc if g is not None)
            sums[f"grad/{name}_norm"] = sums.get(f"grad/{name}_norm", 0.0) + math.sqrt(squares)
        self.term_grads = {}


def _add(sums: dict[str, float], key: str, value: torch.Tensor) -> None:
    sums[key] = sums.get(key, 0.0) + float(value.detach())


def _nothing_kept(w: Weighting) -> Weighting:
    return Weighting(w.old_logp, torch.zeros_like(w.weight), torch.zeros_like(w.keep))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's own shard (an FSDP2 DTensor's local tensor), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _value(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (FSDP2's gradient norm is one, over every rank's shard)."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def _split(w: Weighting, sizes: list[int]) -> list[Weighting]:
    """The whole batch's weighting cut into micro-batches of ``sizes`` tokens."""
    return [
        Weighting(o, wt, k)
        for o, wt, k in zip(w.old_logp.split(sizes), w.weight.split(sizes), w.keep.split(sizes), strict=True)
    ]


def check_integrity(learner: Learner, cfg: Config, step: int, nonfinite_run: int) -> None:
    """Stop before a broken model is used or checkpointed: weights that are no longer finite, or
    ``train.max_nonfinite_steps`` updates in a row skipped for a non-finite loss or gradient."""
    last_saved = "no checkpoint was written" if step == 0 else "earlier checkpoints are intact"
    if not learner.weights_finite():
        raise KVStreamsError(
            f"step {step + 1}: the update left non-finite weights (optim.lr = {cfg.optim.lr:g}); "
            f"nothing from this step is saved and {last_saved}"
        )
    if nonfinite_run >= cfg.train.max_nonfinite_steps:
        raise KVStreamsError(
            f"step {step + 1}: {nonfinite_run} updates in a row skipped for a non-finite loss or gradient "
            f"(train.max_nonfinite_steps = {cfg.train.max_nonfinite_steps}); check optim.lr and the loss "
            f"coefficients; {last_saved}"
        )

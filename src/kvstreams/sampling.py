"""Token sampling: temperature, top-k, top-p; the recorded log-prob is the one sampled from.

The sampling law both sides stand on: the samplers (``engine/``, ``episodes.py``) draw with
:func:`sample`, the learner (``replay/``, ``train/learner.py``) scores with :func:`policy_logprobs`,
and neither side imports the other.

The sampler draws from the truncated distribution (top-k / top-p applied to the temperature-scaled
logits, renormalised) and records that distribution's log-prob of the drawn token. The learner
applies the same :func:`truncate` to its own logits (the trace keeps ``top_k``/``top_p``), so
with ``top_p < 1`` the PPO ratio and the mismatch metrics compare the distribution actually sampled
from; a learner that skipped the truncation would show the gap in ``mismatch/*``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstreams.errors import KVStreamsError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy; its log-probs are then recorded at temperature 1, untruncated
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    stop_token_ids: tuple[int, ...] | None = None  # None: the tokenizer's end-of-turn token
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise KVStreamsError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise KVStreamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise KVStreamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise KVStreamsError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def logprob_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Half precision up to float32; float64 (an exact reference run) stays float64."""
    return x if x.dtype == torch.float64 else x.float()


def truncate(
    scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0, always: torch.Tensor | None = None
) -> torch.Tensor:
    """Temperature-scaled logits [..., V] with -inf outside the top-k and top-p sets.

    top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p`` (the token
    that crosses it stays). ``always`` [...] names a token per row that stays whatever its rank: the
    learner passes the sampled token, which the sampler's set held by construction, so float noise
    at the boundary can never make a sampled token impossible.
    """
    out = scaled
    if 0 < top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        out = out.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if always is not None and out is not scaled:
        index = always[..., None]
        out = out.scatter(-1, index, scaled.gather(-1, index))
    return out


def policy_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """log pi(target) [...] under the distribution the sampler draws from: logits [..., V] scaled by
    ``temperature``, truncated to top-k / top-p (the target always kept), renormalised."""
    scaled = truncate(at_least_float32(logits) / temperature, top_k, top_p, always=targets)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], log-probs [B] of the distribution sampled from)."""
    logits = at_least_float32(logits)
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(truncate(logits / params.temperature, params.top_k, params.top_p), dim=-1)
    tokens = draw(
        logp.exp(), torch.rand(logp.shape[0], 1, generator=generator, dtype=torch.float64, device=logp.device)
    )
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] by inverse transform sampling, ``u`` [B, 1] uniform in [0, 1).

    The law of ``torch.multinomial(probs, 1)`` at a fifth of its CPU time on a 49k vocabulary (it
    spends its time drawing exponentials; this draws one uniform per row and searches a cumulative
    sum). The sum is in float64, so its rounding (~1e-16 relative) moves no measurable mass between
    tokens, and ``right=True`` finds the token whose interval [cdf[i-1], cdf[i]) holds u: an empty
    interval (probability 0, outside top-k / top-p) is never chosen."""
    cdf = probs.double().cumsum(dim=-1)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    past_end = (
        index >= probs.shape[-1]
    )  # u * total rounded up to total (odds ~2^-53): the last possible token
    if bool(past_end.any()):
        last_possible = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
        index = torch.where(past_end, last_possible, index)
    return index

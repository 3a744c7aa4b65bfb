"""Token sampling: temperature, top-k, top-p; the recorded log-prob is taken before truncation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstreams.errors import KVStreamsError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy; its log-probs are then recorded at temperature 1
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


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], log-probs [B] under softmax(logits / temperature))."""
    logits = logits.float()
    logp = torch.log_softmax(logits / params.logprob_temperature, dim=-1)
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    filtered = logits / params.temperature
    if params.top_k > 0 and params.top_k < filtered.shape[-1]:
        kth = filtered.topk(params.top_k, dim=-1).values[..., -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = filtered.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p  # keeps the token that crosses top_p
        filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    tokens = torch.multinomial(filtered.softmax(dim=-1), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

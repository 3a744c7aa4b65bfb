"""The one attention function kvstreams registers with transformers.

Both the rollout engine and the learner replay run the *unmodified* Hugging Face model. They make an
attention context active around the model call (``with attention_context(ctx): model(...)``); this
function hands each layer's query/key/value to that context. Any other call (plain ``model(ids)``,
``generate``) takes transformers' SDPA path unchanged. A context variable, rather than the model's
``attention_mask`` argument, carries the context because model families treat that argument
differently (Llama always builds a mask from it, Qwen accepts prebuilt ones).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch


class AttentionContext(Protocol):
    """What the engine's decode/prefill steps and the replay masks implement."""

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """query [B, H, Q, D], key/value [B, H_kv, Q, D] (RoPE applied) -> output [B, Q, H, D]."""
        ...


ATTN_NAME = "kvstreams"
_ACTIVE: ContextVar[AttentionContext | None] = ContextVar("kvstreams_attention_context", default=None)


@contextmanager
def attention_context(ctx: AttentionContext) -> Iterator[None]:
    """Route every kvstreams attention layer called inside the block to ``ctx``."""
    token = _ACTIVE.set(ctx)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def kvstreams_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx = _ACTIVE.get()
    if ctx is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return ctx.attend(module, query, key, value, scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def kvstreams_mask(*args, **kwargs):
    """transformers' mask builder for this implementation: none needed while a context is active
    (the context masks by itself; building a T x T mask here would defeat the flex path)."""
    if _ACTIVE.get() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def install() -> None:
    """Register the function (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, kvstreams_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvstreams_mask)

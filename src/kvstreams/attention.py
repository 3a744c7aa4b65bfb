"""The one attention function kvstreams registers with transformers.

Both the rollout engine and the learner replay run the *unmodified* Hugging Face model. They make an
attention context active around the model call (``with ctx: model(...)``, :class:`AttentionContext`);
this function hands each layer's query/key/value to that context. Any other call (plain ``model(ids)``,
``generate``) takes transformers' SDPA path unchanged. A context variable, rather than the model's
``attention_mask`` argument, carries the context because model families treat that argument
differently (Llama always builds a mask from it, Qwen accepts prebuilt ones).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextvars import ContextVar

import torch


class AttentionContext(ABC):
    """The base of kvstreams' four attention contexts: the engine's prefill, decode and chunk steps and
    the learner's replay mask. The base owns the hook: ``with ctx: model(...)`` routes every kvstreams
    attention layer called inside the block to ``ctx.attend``; each context implements that one
    method (as kvpress's ``BasePress`` owns the forward hook and each press implements ``compress``).
    """

    @abstractmethod
    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Layer ``layer``'s query [B, H, Q, D], key/value [B, H_kv, Q, D] (RoPE applied) -> output
        [B, Q, H, D] (the layout transformers expects from an attention function)."""

    def __enter__(self) -> AttentionContext:
        self._tokens = [*getattr(self, "_tokens", []), _ACTIVE.set(self)]
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._tokens.pop())


ATTN_NAME = "kvstreams"
_ACTIVE: ContextVar[AttentionContext | None] = ContextVar("kvstreams_attention_context", default=None)


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
        return ctx.attend(module.layer_idx, query, key, value, scale), None
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

"""Attention over cache slots, shared by every engine step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstreams.sampling import at_least_float32


def attend_slots(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, H, C, D] over slots keys/values [B, H_kv, S, D] where ``visible`` [B, H_kv, C, S].

    Returns the output [B, C, H, D] (the layout transformers expects from an attention function) and
    the attention probabilities [B, H_kv, group, C, S] (float32, float64 for a float64 model), which
    score-based eviction policies need. Computed in at least float32: slots hold only the entries a
    query may see, so this costs O(C * S), never O(C * T).
    """
    B, H, C, D = query.shape
    Hkv = keys.shape[1]
    g, S = H // Hkv, keys.shape[2]
    q = at_least_float32(query).reshape(B, Hkv, g * C, D)  # fold the KV group into rows: no K/V copies
    scores = (q @ at_least_float32(keys).transpose(-1, -2)).view(B, Hkv, g, C, S) * scale
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = probs.view(B, Hkv, g * C, S) @ at_least_float32(values)  # [B, Hkv, g * C, D]
    return out.view(B, H, C, D).transpose(1, 2).to(query.dtype), probs


def attend_slots_fused(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`attend_slots` without the probabilities, through the fused SDPA kernel.

    For steps whose policy needs no attention statistics (chunks of multi-turn episodes, decoding
    without a score-based policy): the probabilities are never materialised, which on CPU makes a
    long chunk several times faster. Returns [B, C, H, D].
    """
    group = query.shape[1] // keys.shape[1]
    mask = visible if group == 1 else visible.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        query, keys.to(query.dtype), values.to(query.dtype), attn_mask=mask, scale=scale, enable_gqa=group > 1
    )
    return out.transpose(1, 2)

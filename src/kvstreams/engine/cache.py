"""Fixed-capacity KV storage with in-place eviction, and the record of when each entry died.

Every (sequence, layer, KV head) owns ``capacity`` slots. A new entry goes into a free slot; an
evicted entry's slot is simply marked free and reused by the next token. Retained entries keep the
K/V (RoPE already applied, so their original positions) they were written with: nothing is moved,
re-indexed or recomputed. Attention is order-free, so slots need no ordering; ``index`` says which
trace token each slot holds.

``death[b, l, h, j]`` is the trace index of the first query that can no longer see entry ``j``: it is
written at the moment of eviction, which is exactly the record the learner replays.
"""

from __future__ import annotations

import torch

from kvstreams.models import ModelShape

NEVER = torch.iinfo(torch.int32).max


class SlotCache:
    def __init__(
        self,
        shape: ModelShape,
        batch: int,
        capacity: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        track: frozenset[str] = frozenset(),
    ) -> None:
        L, H, D = shape.n_layers, shape.n_kv_heads, shape.head_dim
        self.capacity = capacity
        self.keys = torch.zeros(L, batch, H, capacity, D, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.index = torch.full((L, batch, H, capacity), -1, dtype=torch.long, device=device)
        self.death = torch.full((batch, L, H, max_len), NEVER, dtype=torch.int32, device=device)
        stat = lambda: torch.zeros(L, batch, H, capacity, dtype=torch.float32, device=device)  # noqa: E731
        self.cumulative = stat() if "cumulative" in track else None
        self.window = stat() if "window" in track else None

    # --- size ---------------------------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        """Bytes allocated for K and V (what the budget bounds)."""
        return 2 * self.keys.numel() * self.keys.element_size()

    def live_counts(self, layer: int = 0) -> torch.Tensor:
        """[B, H] live entries per KV head."""
        return (self.index[layer] >= 0).sum(-1)

    # --- writes ------------------------------------------------------------------------------------
    def store_prefill(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        index: torch.Tensor,
        keep: torch.Tensor,
        cumulative: torch.Tensor | None,
        window: torch.Tensor | None,
    ) -> None:
        """Write the kept prompt entries (``keep`` [B, H, P]) into the first slots."""
        order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)  # kept columns first
        n = min(self.capacity, keys.shape[2])
        sel = order[..., :n]
        D = keys.shape[-1]
        gather = lambda t: t.gather(2, sel.unsqueeze(-1).expand(-1, -1, -1, D))  # noqa: E731
        self.keys[layer, :, :, :n] = gather(keys)
        self.values[layer, :, :, :n] = gather(values)
        kept = keep.gather(-1, sel)
        self.index[layer, :, :, :n] = torch.where(kept, index.gather(-1, sel), -1)
        for stat, src in ((self.cumulative, cumulative), (self.window, window)):
            if stat is not None and src is not None:
                stat[layer, :, :, :n] = torch.where(kept, src.gather(-1, sel), 0.0)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor, query_index: torch.Tensor) -> None:
        """Write one new entry per (sequence, head) into a free slot. key/value [B, H, 1, D]."""
        free = self.index[layer] < 0
        slot = free.to(torch.int8).argmax(dim=-1, keepdim=True)  # [B, H, 1], first free slot
        D = key.shape[-1]
        self.keys[layer].scatter_(2, slot.unsqueeze(-1).expand(-1, -1, -1, D), key)
        self.values[layer].scatter_(2, slot.unsqueeze(-1).expand(-1, -1, -1, D), value)
        self.index[layer].scatter_(2, slot, query_index.view(-1, 1, 1).expand_as(slot))
        for stat in (self.cumulative, self.window):
            if stat is not None:
                stat[layer].scatter_(2, slot, 0.0)

    def record_death(self, layer: int, evicted: torch.Tensor, index: torch.Tensor, at: torch.Tensor) -> None:
        """Entries ``evicted`` ([B, H, N] over candidates whose trace indices are ``index``) die at ``at`` [B]."""
        b, h, n = evicted.nonzero(as_tuple=True)
        if b.numel():
            self.death[b, layer, h, index[b, h, n]] = at[b].to(torch.int32)

    def evict_slots(self, layer: int, evicted: torch.Tensor, at: torch.Tensor) -> None:
        """Free the slots marked in ``evicted`` [B, H, S] and record their entries' death."""
        self.record_death(layer, evicted, self.index[layer], at)
        self.index[layer].masked_fill_(evicted, -1)
        for stat in (self.cumulative, self.window):
            if stat is not None:
                stat[layer].masked_fill_(evicted, 0.0)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences ``rows`` (finished ones leave the batch)."""
        self.keys = self.keys.index_select(1, rows)
        self.values = self.values.index_select(1, rows)
        self.index = self.index.index_select(1, rows)
        self.death = self.death.index_select(0, rows)
        if self.cumulative is not None:
            self.cumulative = self.cumulative.index_select(1, rows)
        if self.window is not None:
            self.window = self.window.index_select(1, rows)

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
from kvstreams.visibility import NEVER


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

    def write_chunk(self, layer: int, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> None:
        """Write up to C new entries per sequence into free slots (the first C free ones).

        keys/values [B, H, C, D]; ``index`` [B, C] trace indices, -1 for padding columns. A padding
        column's K/V land in a slot that stays free: harmless, free slots are never attended.
        Callers :meth:`reserve` room first.
        """
        B, H, C, D = keys.shape
        slots = _first_free(self.index[layer], C)
        expand = slots.unsqueeze(-1).expand(-1, -1, -1, D)
        self.keys[layer].scatter_(2, expand, keys)
        self.values[layer].scatter_(2, expand, values)
        self.index[layer].scatter_(2, slots, index[:, None, :].expand(B, H, C))
        for stat in (self.cumulative, self.window):
            if stat is not None:
                stat[layer].scatter_(2, slots, 0.0)

    def write_rows(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`write_chunk` for a subset ``rows`` of the sequences (keys/values [len(rows), H, C, D]).

        Returns those rows' keys, values and slot index after the write, for attention. Rows that have
        nothing to feed then cost nothing. The new entries' attention statistics start at zero.
        """
        B, H, C, D = keys.shape
        k = self.keys[layer].index_select(0, rows)
        v = self.values[layer].index_select(0, rows)
        i = self.index[layer].index_select(0, rows)
        slots = _first_free(i, C)
        expand = slots.unsqueeze(-1).expand(-1, -1, -1, D)
        k.scatter_(2, expand, keys)
        v.scatter_(2, expand, values)
        i.scatter_(2, slots, index[:, None, :].expand(B, H, C))
        self.keys[layer].index_copy_(0, rows, k)
        self.values[layer].index_copy_(0, rows, v)
        self.index[layer].index_copy_(0, rows, i)
        for stat in (self.cumulative, self.window):
            if stat is not None:
                stat[layer].index_copy_(0, rows, stat[layer].index_select(0, rows).scatter_(2, slots, 0.0))
        return k, v, i

    def evict_rows(self, layer: int, evicted: torch.Tensor, rows: torch.Tensor, at: torch.Tensor) -> None:
        """:meth:`evict_slots` for a subset ``rows`` of the sequences (``evicted`` [len(rows), H, S])."""
        index = self.index[layer].index_select(0, rows)
        b, h, s = evicted.nonzero(as_tuple=True)
        if b.numel():
            self.death[rows[b], layer, h, index[b, h, s]] = at[b].to(torch.int32)
        self.index[layer].index_copy_(0, rows, index.masked_fill(evicted, -1))
        for stat in (self.cumulative, self.window):
            if stat is not None:
                stat[layer].index_copy_(0, rows, stat[layer].index_select(0, rows).masked_fill(evicted, 0.0))

    def free_slots(self) -> torch.Tensor:
        """[B] the fewest free slots over layers and heads, per sequence."""
        return (self.index < 0).sum(-1).amin(dim=(0, 2))

    def reserve(self, n_free: int) -> None:
        """Grow (doubling) until every sequence has ``n_free`` free slots in every layer and head."""
        short = n_free - int(self.free_slots().min())
        if short <= 0:
            return
        grow = max(short, self.capacity)

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            extra = torch.full((*t.shape[:3], grow, *t.shape[4:]), value, dtype=t.dtype, device=t.device)
            return torch.cat([t, extra], dim=3)

        self.keys, self.values = pad(self.keys, 0), pad(self.values, 0)
        self.index = pad(self.index, -1)
        if self.cumulative is not None:
            self.cumulative = pad(self.cumulative, 0.0)
        if self.window is not None:
            self.window = pad(self.window, 0.0)
        self.capacity += grow

    def reserve_time(self, length: int) -> None:
        """Make the death record long enough for traces of ``length`` tokens."""
        current = self.death.shape[-1]
        if length <= current:
            return
        extra = max(length - current, current)
        more = torch.full((*self.death.shape[:3], extra), NEVER, dtype=torch.int32, device=self.death.device)
        self.death = torch.cat([self.death, more], dim=-1)

    def evict_range(self, row: int, start: int, end: int, at: int) -> int:
        """Evict sequence ``row``'s live entries with trace index in [start, end) from every layer and
        head; they die at query ``at``. Returns how many were live in layer 0, head 0 (under
        compression, heads may hold different entries)."""
        index = self.index[:, row]  # [L, H, S]
        hit = (index >= start) & (index < end)
        n = int(hit[0, 0].sum())
        if bool(hit.any()):  # under compression, heads hold different entries
            layers, heads, slots = hit.nonzero(as_tuple=True)
            self.death[row, layers, heads, index[layers, heads, slots]] = at
            self.index[:, row].masked_fill_(hit, -1)
        return n

    def clear_row(self, row: int) -> None:
        """Forget sequence ``row`` entirely (a new trace starts there); nothing is recorded."""
        self.index[:, row] = -1
        self.death[row] = NEVER
        for stat in (self.cumulative, self.window):
            if stat is not None:
                stat[:, row] = 0.0

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


def _first_free(index: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, n] the first ``n`` free slots (index < 0) of every (sequence, head), in O(S)."""
    free = index < 0
    if n == 1:
        return free.to(torch.int8).argmax(dim=-1, keepdim=True)
    rank = free.cumsum(dim=-1) - 1
    target = torch.where(free & (rank < n), rank, n)  # non-candidates go to a dummy column n
    out = torch.zeros(*free.shape[:-1], n + 1, dtype=torch.long, device=free.device)
    slot_ids = torch.arange(free.shape[-1], device=free.device).expand_as(target)
    return out.scatter_(-1, target, slot_ids)[..., :n]

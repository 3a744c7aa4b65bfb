"""Fixed-capacity KV storage with in-place eviction, and the record of when each entry died.

Every (sequence, layer, KV head) owns ``capacity`` slots. A new entry goes into a free slot; an
evicted entry's slot is simply marked free and reused by the next token. Retained entries keep the
K/V (RoPE already applied, so their original positions) they were written with: nothing is moved,
re-indexed or recomputed. Attention is order-free, so slots need no ordering; ``index`` says which
trace token each slot holds.

``death[b, l, h, j]`` is the trace index of the first query that can no longer see entry ``j``: it is
written at the moment of eviction, which is exactly the record the learner replays.

Recall: a span evicted with ``archive=True`` keeps its entries' K/V in an archive (per sequence, per
layer and KV head: only the entries that were live there); :meth:`SlotCache.recall` writes them back
into free slots, unchanged (same K/V, same original positions), and opens a further visibility
interval ``recalls[b, l, h, j, k] = (start, NEVER)`` that a later eviction closes. The recall record
is allocated on the first recall only, so a cache that never recalls holds and writes exactly what
it did before.
"""

from __future__ import annotations

import torch

from kvstreams.models import ModelShape
from kvstreams.visibility import NEVER


class _Archive:
    """One sequence's archived entries (evicted with ``archive=True``): where each lived (layer, KV head,
    trace index) and its K/V [N, D]."""

    def __init__(self, layer, head, entry, keys, values) -> None:
        self.layer, self.head, self.entry, self.keys, self.values = layer, head, entry, keys, values

    def add(self, other: _Archive) -> _Archive:
        return _Archive(*(torch.cat([a, b]) for a, b in zip(self.fields(), other.fields(), strict=True)))

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.layer, self.head, self.entry, self.keys, self.values

    def take(self, pick: torch.Tensor) -> tuple[_Archive, _Archive | None]:
        """(the entries marked in ``pick``, the rest or None when nothing is left)."""
        taken = _Archive(*(t[pick] for t in self.fields()))
        rest = _Archive(*(t[~pick] for t in self.fields()))
        return taken, (rest if rest.entry.numel() else None)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


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
        # recall (allocated on the first recall): intervals [b, L, H, T, K, 2] and how many each entry opened
        self.recalls: torch.Tensor | None = None
        self.n_recalls: torch.Tensor | None = None
        self.archive: list[_Archive | None] = [None] * batch

    # --- size ---------------------------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        """Bytes allocated for K and V (what the budget bounds)."""
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def archive_bytes(self) -> int:
        """Bytes of K and V held in the archive (evicted entries kept for recall)."""
        return sum(a.nbytes for a in self.archive if a is not None)

    # --- the record -----------------------------------------------------------------------------------
    def _die(self, b: torch.Tensor, layer, head: torch.Tensor, entry: torch.Tensor, at: torch.Tensor) -> None:
        """Entries (b, layer, head, entry) stop being visible from query ``at``: their first interval
        ends (``death``), or, for a recalled entry, its latest recall interval."""
        at = at.to(torch.int32)
        if self.n_recalls is None:
            self.death[b, layer, head, entry] = at
            return
        layer = torch.as_tensor(layer, device=b.device).expand_as(b)
        k = self.n_recalls[b, layer, head, entry].long()
        first = k == 0
        self.death[b[first], layer[first], head[first], entry[first]] = at[first]
        rest = ~first
        if bool(rest.any()):
            assert self.recalls is not None
            self.recalls[b[rest], layer[rest], head[rest], entry[rest], k[rest] - 1, 1] = at[rest]

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
            self._die(b, layer, h, index[b, h, n], at[b])

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
            self._die(rows[b], layer, h, index[b, h, s], at[b])
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
        if self.recalls is not None and self.n_recalls is not None:
            r = self.recalls
            self.recalls = torch.cat([r, r.new_zeros(*r.shape[:3], extra, *r.shape[4:])], dim=3)
            self.n_recalls = torch.cat([self.n_recalls, self.n_recalls.new_zeros(*r.shape[:3], extra)], dim=3)

    def evict_range(self, row: int, start: int, end: int, at: int, archive: bool = False) -> int:
        """Evict sequence ``row``'s live entries with trace index in [start, end) from every layer and
        head; they die at query ``at``. With ``archive``, their K/V are kept for :meth:`recall`.
        Returns how many were live in layer 0, head 0 (under compression, heads may hold different
        entries)."""
        index = self.index[:, row]  # [L, H, S]
        hit = (index >= start) & (index < end)
        n = int(hit[0, 0].sum())
        if bool(hit.any()):  # under compression, heads hold different entries
            layers, heads, slots = hit.nonzero(as_tuple=True)
            entries = index[layers, heads, slots]
            rows = torch.full_like(layers, row)
            self._die(rows, layers, heads, entries, torch.full_like(layers, at))
            if archive:
                kept = _Archive(
                    layers,
                    heads,
                    entries,
                    self.keys[layers, row, heads, slots],
                    self.values[layers, row, heads, slots],
                )
                old = self.archive[row]
                self.archive[row] = kept if old is None else old.add(kept)
            self.index[:, row].masked_fill_(hit, -1)
        return n

    def recall(self, row: int, start: int, end: int, at: int) -> int:
        """Put sequence ``row``'s archived entries with trace index in [start, end) back into free slots,
        with the K/V they were written with; they are visible again from query ``at`` (a new interval
        in :attr:`recalls`, open until a later eviction). Returns how many came back in layer 0, head 0."""
        archived = self.archive[row]
        if archived is None:
            return 0
        taken, self.archive[row] = archived.take((archived.entry >= start) & (archived.entry < end))
        if taken.entry.numel() == 0:
            return 0
        L, H = self.index.shape[0], self.index.shape[2]
        cell = taken.layer * H + taken.head
        per_cell = torch.bincount(cell, minlength=L * H)
        self.reserve(int(per_cell.max()))
        for c in per_cell.nonzero().flatten().tolist():  # each (layer, head): its first free slots
            layer, head = divmod(c, H)
            sel = cell == c
            slots = (self.index[layer, row, head] < 0).nonzero().flatten()[: int(per_cell[c])]
            self.keys[layer, row, head, slots] = taken.keys[sel]
            self.values[layer, row, head, slots] = taken.values[sel]
            self.index[layer, row, head, slots] = taken.entry[sel]
            for stat in (self.cumulative, self.window):
                if stat is not None:
                    stat[layer, row, head, slots] = 0.0
        self._open_interval(row, taken, at)
        return int(per_cell[0])

    def _open_interval(self, row: int, taken: _Archive, at: int) -> None:
        """Recalled entries' next visibility interval starts at ``at`` (open: it ends when evicted)."""
        B, L, H, T = self.death.shape
        if self.n_recalls is None:
            self.n_recalls = torch.zeros(B, L, H, T, dtype=torch.int32, device=self.death.device)
            self.recalls = torch.zeros(B, L, H, T, 0, 2, dtype=torch.int32, device=self.death.device)
        assert self.recalls is not None
        cell = (row, taken.layer, taken.head, taken.entry)
        k = self.n_recalls[cell].long()
        if int(k.max()) + 1 > self.recalls.shape[4]:  # one more interval per entry
            self.recalls = torch.cat([self.recalls, self.recalls.new_zeros(B, L, H, T, 1, 2)], dim=4)
        self.recalls[(*cell, k, 0)] = at
        self.recalls[(*cell, k, 1)] = NEVER
        self.n_recalls[cell] += 1

    def clear_row(self, row: int) -> None:
        """Forget sequence ``row`` entirely (a new trace starts there); nothing is recorded."""
        self.index[:, row] = -1
        self.death[row] = NEVER
        for stat in (self.cumulative, self.window):
            if stat is not None:
                stat[:, row] = 0.0
        if self.recalls is not None and self.n_recalls is not None:
            self.recalls[row] = 0
            self.n_recalls[row] = 0
        self.archive[row] = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences ``rows`` (finished ones leave the batch)."""
        self.keys = self.keys.index_select(1, rows)
        self.values = self.values.index_select(1, rows)
        self.index = self.index.index_select(1, rows)
        self.death = self.death.index_select(0, rows)
        if self.recalls is not None and self.n_recalls is not None:
            self.recalls = self.recalls.index_select(0, rows)
            self.n_recalls = self.n_recalls.index_select(0, rows)
        self.archive = [self.archive[int(r)] for r in rows]
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

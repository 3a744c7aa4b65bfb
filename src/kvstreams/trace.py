"""The trace: one sampled sequence, everything the learner needs to replay exactly what the sampler saw.

Saved as ONE ``.safetensors`` file; the tensor names and metadata keys below are a public contract
(see docs/trace-format.md):

- ``tokens`` int64 [T], ``positions`` int64 [T] (the RoPE position each KV entry was written with)
- ``death`` int32 [L or 1, H_kv or 1, T]: trace index of the first query that can no longer see entry
  j (T if never evicted). ``visible(q, j) <=> j <= q < death[l, h, j]`` (:mod:`kvstreams.visibility`).
- optional ``recalls`` int32 [L or 1, H_kv or 1, T, K, 2] (format ``kvstreams-trace/2``): further
  intervals [start, end) over which a recalled entry is visible again; (0, 0) is no interval.
- ``sampled_mask`` bool [T], ``loss_mask`` bool [T], ``sampler_logprobs`` float32 [T] (NaN where not
  sampled), optional ``weights_version`` int32 [T]
- metadata: ``format`` = ``kvstreams-trace/1``, ``temperature``, ``policy``, ``mode``, ``model``, ...
  and ``digest`` (``sha256-v1:<hex>`` of every tensor and every other metadata value, written by
  :meth:`Trace.to_bytes` and checked on load: a flipped byte that leaves the record valid -- a
  ``death`` value one step earlier replays another visibility -- is refused, not replayed).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstreams import visibility
from kvstreams.atomic import atomic_write
from kvstreams.errors import TraceFormatError

FORMAT = "kvstreams-trace/1"
#: traces with recall intervals: readers of /1 refuse them rather than replay them without the recalls
FORMAT_RECALL = "kvstreams-trace/2"
FORMATS = (FORMAT, FORMAT_RECALL)
REQUIRED_METADATA = ("format", "temperature", "policy", "mode", "model")
MODES = ("stream", "reprefill", "full")
DIGEST = "digest"
DIGEST_SCHEME = "sha256-v1"
_DTYPES = {
    "tokens": torch.int64,
    "positions": torch.int64,
    "death": torch.int32,
    "sampled_mask": torch.bool,
    "loss_mask": torch.bool,
    "sampler_logprobs": torch.float32,
    "weights_version": torch.int32,
    "recalls": torch.int32,
}
_OPTIONAL = ("weights_version", "recalls")
#: tensors that had another name in earlier files (read under the new one)
_FORMER_NAMES = {"policy_version": "weights_version"}


@dataclass
class Trace:
    tokens: torch.Tensor
    positions: torch.Tensor
    death: torch.Tensor
    sampled_mask: torch.Tensor
    loss_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    metadata: dict[str, str] = field(default_factory=dict)
    weights_version: torch.Tensor | None = None
    recalls: torch.Tensor | None = None

    @classmethod
    def from_record(
        cls,
        tokens: list[int],
        death: torch.Tensor,
        sampled: list[bool],
        loss: list[bool],
        logprobs: list[float],
        versions: list[int],
        metadata: dict[str, str],
        recalls: torch.Tensor | None = None,
    ) -> Trace:
        """A stream trace from what an engine recorded. ``death`` is the engine's [L, H, >= T] buffer,
        whose never-evicted entries hold a sentinel above T; positions are the trace indices.
        ``recalls`` [L, H, >= T, K, 2]: the recall intervals, if the engine recalled anything."""
        T = len(tokens)
        death = visibility.at_end(death, T).cpu()
        if recalls is not None:
            recalls = visibility.recalls_at_end(recalls, T).cpu()
            recalls = recalls if bool((recalls[..., 0] < recalls[..., 1]).any()) else None
        death, recalls = compact_record(death, recalls)
        return cls(
            tokens=torch.tensor(tokens, dtype=torch.long),
            positions=torch.arange(T, dtype=torch.long),
            death=death,
            sampled_mask=torch.tensor(sampled, dtype=torch.bool),
            loss_mask=torch.tensor(loss, dtype=torch.bool),
            sampler_logprobs=torch.tensor(logprobs, dtype=torch.float32),
            weights_version=torch.tensor(versions, dtype=torch.int32),
            metadata={"format": FORMAT if recalls is None else FORMAT_RECALL, **metadata},
            recalls=recalls,
        )

    # --- accessors --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def temperature(self) -> float:
        """Temperature the sampler's log-probs refer to (greedy traces record temperature 1)."""
        t = float(self.metadata["temperature"])
        return t if t > 0 else 1.0

    @property
    def top_k(self) -> int:
        """top-k truncation the sampler applied (0: none; greedy traces record none)."""
        return int(self.metadata.get("top_k", "0")) if float(self.metadata["temperature"]) > 0 else 0

    @property
    def top_p(self) -> float:
        """top-p truncation the sampler applied (1: none; greedy traces record none)."""
        return float(self.metadata.get("top_p", "1")) if float(self.metadata["temperature"]) > 0 else 1.0

    def death_for(self, n_layers: int, n_kv_heads: int) -> torch.Tensor:
        """``death`` broadcast to [n_layers, n_kv_heads, T]."""
        L, H, T = self.death.shape
        if L not in (1, n_layers) or H not in (1, n_kv_heads):
            raise TraceFormatError(
                f"trace death has shape {tuple(self.death.shape)}, which does not fit a model with "
                f"{n_layers} layers and {n_kv_heads} KV heads"
            )
        return self.death.expand(n_layers, n_kv_heads, T)

    def visible(self, layer: int = 0, head: int = 0) -> torch.Tensor:
        """Dense [T, T] bool visibility of one layer and KV head (for inspection and tests)."""
        at = (min(layer, self.death.shape[0] - 1), min(head, self.death.shape[1] - 1))
        return visibility.dense(self.death[at], None if self.recalls is None else self.recalls[at])

    def visible_to(self, query: int) -> torch.Tensor:
        """bool [L or 1, H or 1, T]: which entries ``query`` sees, per layer and KV head."""
        j = torch.arange(len(self))
        return visibility.visible(query, j, self.death, self.recalls)

    def visible_counts(self) -> torch.Tensor:
        """[L or 1, H or 1, T]: how many entries query q sees, per layer and KV head (the KV cache it
        needed when it was computed)."""
        return visibility.visible_counts(self.death, self.recalls)

    def kv_saving(self) -> float:
        """The realised KV saving of the sampled tokens' queries, SMD's "Toks. saving" (Table 6):
        1 - (entries they saw) / (entries a full cache holds), summed over those queries, averaged
        over layers and KV heads. 0 without eviction; ~0.5 for a 50% per-sequence budget."""
        queries = self.sampled_mask.nonzero().squeeze(-1) - 1  # the query that sampled token t is t - 1
        if queries.numel() == 0:
            return 0.0
        seen = self.visible_counts()[..., queries].double().sum(-1)  # [L, H]
        return float(1 - seen.mean() / (queries + 1).double().sum())

    @property
    def n_evicted(self) -> int:
        """Entries evicted before the end of the trace (counted over all layers and heads)."""
        return int((self.death < len(self)).sum())

    @property
    def n_recalled(self) -> int:
        """Recall intervals: times an entry came back after an eviction (over the stored layers and heads)."""
        return 0 if self.recalls is None else int((self.recalls[..., 0] < self.recalls[..., 1]).sum())

    # --- checks ------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Every field present with its dtype and shape, a record the rule can replay, sampler
        log-probs where (and only where) tokens were sampled, the metadata a learner needs."""
        self._check_tensors()
        self._check_record()
        self._check_metadata()

    def _check_tensors(self) -> None:
        tensors = {name: getattr(self, name) for name in _DTYPES}
        for name, tensor in tensors.items():
            if tensor is None:
                if name in _OPTIONAL:
                    continue
                raise TraceFormatError(f"trace is missing tensor {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise TraceFormatError(f"trace field {name!r} is not a tensor")
            if tensor.dtype != _DTYPES[name]:
                raise TraceFormatError(
                    f"trace tensor {name!r} has dtype {tensor.dtype}, expected {_DTYPES[name]}"
                )
        if self.tokens.dim() != 1 or len(self) < 1:
            raise TraceFormatError(
                f"trace tokens must be a non-empty 1-D tensor, got shape {tuple(self.tokens.shape)}"
            )
        T = len(self)
        for name in ("positions", "sampled_mask", "loss_mask", "sampler_logprobs", "weights_version"):
            tensor = tensors[name]
            if tensor is not None and tuple(tensor.shape) != (T,):
                raise TraceFormatError(
                    f"trace tensor {name!r} has shape {tuple(tensor.shape)}, expected ({T},)"
                )

    def _check_record(self) -> None:
        T = len(self)
        if self.death.dim() != 3 or self.death.shape[-1] != T:
            raise TraceFormatError(
                f"trace death has shape {tuple(self.death.shape)}, expected (L or 1, H_kv or 1, {T})"
            )
        j = torch.arange(T, dtype=torch.int32)
        if bool((self.death <= j).any()):
            bad = int((self.death <= j).nonzero()[0, -1])
            raise TraceFormatError(
                f"trace death[..., {bad}] <= {bad}: an entry must be visible at least to its own query"
            )
        if bool((self.death > T).any()):
            raise TraceFormatError(f"trace death values exceed the trace length {T}")
        if self.recalls is not None:
            self._check_recalls()
        if bool((self.positions < 0).any()):
            raise TraceFormatError("trace positions must be >= 0")
        if bool(self.sampled_mask[0]):
            raise TraceFormatError("trace token 0 cannot be sampled (no query precedes it)")
        lp = self.sampler_logprobs
        if bool((self.tokens < 0).any()):
            raise TraceFormatError("trace token ids must be >= 0")
        if bool((~torch.isfinite(lp[self.sampled_mask])).any()) or bool((lp[self.sampled_mask] > 1e-4).any()):
            raise TraceFormatError(
                "trace sampler_logprobs must be finite log-probabilities (<= 0) at sampled tokens"
            )
        if not bool(torch.isnan(lp[~self.sampled_mask]).all()):
            raise TraceFormatError("trace sampler_logprobs must be NaN where sampled_mask is False")

    def _check_recalls(self) -> None:
        """Recall intervals: shaped like ``death`` plus [K, 2]; each non-empty one starts at or after
        the previous interval's end (``death`` first) and ends by T; empty ones are (0, 0) and last."""
        T, r = len(self), self.recalls
        assert r is not None
        if r.dim() != 5 or r.shape[:3] != self.death.shape or r.shape[-1] != 2:
            raise TraceFormatError(
                f"trace recalls has shape {tuple(r.shape)}, expected {tuple(self.death.shape)} + (K, 2)"
            )
        start, end = r[..., 0], r[..., 1]
        empty = start >= end
        if bool((empty & ((start != 0) | (end != 0))).any()):
            raise TraceFormatError("trace recalls: an empty interval must be written (0, 0)")
        if bool((empty[..., :-1] & ~empty[..., 1:]).any()):
            raise TraceFormatError("trace recalls: an interval follows an empty one")
        previous = torch.cat([self.death[..., None], end[..., :-1]], dim=-1)
        if bool((~empty & ((start < previous) | (end > T))).any()):
            raise TraceFormatError(
                "trace recalls: intervals must start at or after the previous one's end and end by T"
            )

    def _check_metadata(self) -> None:
        missing = [k for k in REQUIRED_METADATA if k not in self.metadata]
        if missing:
            raise TraceFormatError(f"trace metadata is missing {', '.join(missing)}")
        fmt = self.metadata["format"]
        if fmt not in FORMATS:
            raise TraceFormatError(f"trace format is {fmt!r}, expected one of {', '.join(FORMATS)}")
        if (fmt == FORMAT_RECALL) != (self.recalls is not None):
            raise TraceFormatError(
                f"trace format {fmt!r} {'needs' if fmt == FORMAT_RECALL else 'cannot hold'} a recalls tensor"
            )
        mode = self.metadata["mode"]
        if mode not in MODES:
            raise TraceFormatError(f"trace mode {mode!r} is not one of {', '.join(MODES)}")
        if mode == "stream" and not torch.equal(self.positions, torch.arange(len(self))):
            # one continuous cache, eviction in place: entry j was written at position j
            raise TraceFormatError("a stream trace's positions must be 0, 1, ..., T-1 (eviction keeps them)")
        try:
            if not 0 <= float(self.metadata["temperature"]) < float("inf"):  # nan fails too
                raise ValueError
        except ValueError:
            raise TraceFormatError(
                f"trace temperature {self.metadata['temperature']!r} is not a finite number >= 0"
            ) from None
        try:
            if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
                raise ValueError
        except ValueError:
            raise TraceFormatError(
                f"trace top_k {self.metadata.get('top_k')!r} / top_p {self.metadata.get('top_p')!r} "
                "must be an integer >= 0 and a number in (0, 1]"
            ) from None

    # --- storage ---------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self, name) for name in _DTYPES if getattr(self, name) is not None}
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    def save(self, path: str | Path) -> Path:
        """Validate, then write atomically (temp file + rename): a reader never sees half a trace."""
        data = self.to_bytes()
        return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))

    def to_bytes(self) -> bytes:
        """The same safetensors bytes :meth:`save` writes (how traces cross processes: tensors and
        string metadata, never pickled objects)."""
        from safetensors.torch import save

        self.validate()
        tensors = self.tensors()
        metadata = {k: str(v) for k, v in self.metadata.items() if k != DIGEST}
        metadata[DIGEST] = digest(tensors, metadata)
        return save(tensors, metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read and validate a trace file; any inconsistency is a :class:`TraceFormatError`."""
        path = Path(path)
        if not path.is_file():
            raise TraceFormatError(f"trace file {str(path)!r} does not exist")
        return cls.from_bytes(path.read_bytes(), where=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "trace bytes") -> Trace:
        """A trace from :meth:`to_bytes` (or a file's contents), validated like :meth:`load`."""
        from safetensors.torch import load

        try:
            metadata = dict(_metadata_of(data))
            tensors = load(data)
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise TraceFormatError(
                f"{where}: not a readable safetensors file ({type(err).__name__}: {err})"
            ) from None
        if _FORMER_NAMES.keys() & tensors.keys():  # files written before the rename
            tensors = {_FORMER_NAMES.get(k, k): v for k, v in tensors.items()}
        unknown = sorted(set(tensors) - set(_DTYPES))
        if unknown:
            raise TraceFormatError(f"{where}: unexpected tensor(s) {', '.join(unknown)}")
        for name in _DTYPES:
            if name not in tensors and name not in _OPTIONAL:
                raise TraceFormatError(f"{where}: trace is missing tensor {name!r}")
        stored = metadata.pop(DIGEST, None)
        if stored is None:
            warnings.warn(
                f"{where}: trace has no digest (written before digests): read unchecked", stacklevel=2
            )
        elif stored != digest(tensors, metadata):
            raise TraceFormatError(
                f"{where}: the trace does not match its digest: the file was altered or corrupted"
            )
        trace = cls(metadata=metadata, **{k: tensors.get(k) for k in _DTYPES})
        try:
            trace.validate()
        except TraceFormatError as err:
            raise TraceFormatError(f"{where}: {err}") from None
        return trace


def digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """``sha256-v1:<hex>`` over every tensor (name, dtype, shape, bytes) and every metadata value but the
    digest itself, in name order: what a trace file holds, independent of how safetensors lays it out."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(json.dumps({k: v for k, v in metadata.items() if k != DIGEST}, sort_keys=True).encode())
    return f"{DIGEST_SCHEME}:{h.hexdigest()}"


def _metadata_of(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes: an 8-byte little-endian header length, then JSON."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 or size > len(data) - 8:
        raise ValueError("header length exceeds the data")
    header = json.loads(data[8 : 8 + size])
    return dict(header.get("__metadata__") or {})


def compact_death(death: torch.Tensor) -> torch.Tensor:
    """Store [L, H, T] as [1, H, T], [L, 1, T] or [1, 1, T] when it is the same along a dimension."""
    return compact_record(death, None)[0]


def compact_record(
    death: torch.Tensor, recalls: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`compact_death` for ``death`` [L, H, T] and ``recalls`` [L, H, T, K, 2] together: a
    dimension shrinks to 1 when both are the same along it."""
    for dim in (0, 1):
        first = (slice(None),) * dim + (slice(0, 1),)
        same = bool((death == death[first]).all())
        if recalls is not None:
            same = same and bool((recalls == recalls[first]).all())
        if same:
            death = death[first]
            recalls = None if recalls is None else recalls[first]
    return death.contiguous(), None if recalls is None else recalls.contiguous()


def print_traces(paths: list[str]) -> None:
    """``kvstreams inspect``: load (and so validate) each trace file and print one row per file."""
    from rich.table import Table

    from kvstreams.progress import console

    table = Table(title="traces")
    for col in (
        "file",
        "tokens",
        "sampled",
        "death shape",
        "evicted entries",
        "policy",
        "mode",
        "temperature",
    ):
        table.add_column(col, no_wrap=True)
    for path in paths:
        t = Trace.load(path)
        table.add_row(
            Path(path).name,
            str(len(t)),
            str(int(t.sampled_mask.sum())),
            str(tuple(t.death.shape)),
            str(t.n_evicted),
            t.metadata["policy"],
            t.metadata["mode"],
            t.metadata["temperature"],
        )
    console().print(table)

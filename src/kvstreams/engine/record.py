"""The trace being built for one sequence, and the one way from it to a :class:`~kvstreams.trace.Trace`.

Both samplers write it: the batched single-turn engine (``engine.py``: the prompt, then one sampled
token per decode step) and the multi-turn stream (``stream.py``: chunks of environment tokens and
sampled replies). The visibility record (``death``, and ``recalls`` after a recall) lives in the
:class:`~kvstreams.engine.cache.SlotCache`; :meth:`Record.to_trace` joins the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvstreams.trace import Trace


@dataclass
class Record:
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    loss: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    fed: int = 0  # tokens already written into the cache (the next query's trace index)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(
        self,
        tokens: list[int],
        version: int,
        sampled: bool = False,
        loss: bool = False,
        logprobs: list[float] | None = None,
    ) -> tuple[int, int]:
        """Add tokens drawn (``sampled``, with their ``logprobs``) or given by weights ``version``.
        Returns their [start, end) trace indices."""
        start = len(self.tokens)
        self.tokens += tokens
        self.sampled += [sampled] * len(tokens)
        self.loss += [loss] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [math.nan] * len(tokens)
        self.versions += [version] * len(tokens)
        return start, len(self.tokens)

    def to_trace(
        self, death: torch.Tensor, metadata: dict[str, str], recalls: torch.Tensor | None = None
    ) -> Trace:
        """The trace, with the cache's visibility record of this sequence (``death`` [L, H, >= T])."""
        return Trace.from_record(
            self.tokens, death, self.sampled, self.loss, self.logprobs, self.versions, metadata, recalls
        )

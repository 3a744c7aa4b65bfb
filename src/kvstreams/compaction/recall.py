"""Recall: bring a deleted unit of an episode's context back when a new observation asks for it.

Compaction deletes the oldest units; a later observation may need one of them again (the memory
environment's final question asks for a fact stated before the compaction). A :class:`Recall` decides,
before an observation joins the context, which deleted units come back. :class:`LexicalRecall`, the one
registered retriever, scores each deleted unit by the words it shares with the observation, each word
weighted by its inverse document frequency over the deleted units (a word every deleted unit has
weighs nothing), the scoring of TF-IDF retrieval (Sparck Jones, 1972) without term frequencies.

How a unit comes back is the runner's ``how``:

- ``archive`` (``stream`` mode): the unit's entries were archived when it was deleted; their K/V go
  back into the cache unchanged, at their original positions, visible again from the next query
  (:meth:`kvstreams.engine.stream.StreamSession.recall`). Nothing is recomputed; the trace records a
  further visibility interval per entry and the learner replays it exactly.
- ``recompute`` (any compacting mode): the unit's tokens are appended again as a new unit, fed
  through the model at new positions (what a retrieval-augmented pipeline does when it pastes a
  retrieved passage back). Costs their prefill; the trace is an ordinary one.

What the deleted units are matched against is the recall's ``trigger``:

- ``observation`` (default): the new observation, a retrieval step the environment loop takes;
- ``model``: what the policy wrote inside ``<recall>...</recall>`` (the last such span of its reply;
  ``tag`` names the element). The policy asks, the units come back before the next observation joins,
  visible from the next turn: a tool call whose result is the policy's own forgotten context. A reply
  without the tag recalls nothing. It is an action like any other token of the reply: the learner
  replays the record, so it is trained on with the same exactness (the tiny models never write the
  tag by themselves; tests force it, docs/results.md names what teaching it would take).

The KV-streams authors' code sketches restoring archived KV and leaves it unresolved (issue #27
quotes a 0.14 mismatch KL from their notes). Here the archive path is exact by construction: the
restored K/V are the sampler's own, and the record says when they were visible. Where we differ from
the issue's wording: ``recompute`` does not write the tokens back at their *original* positions (one
trace index holds one K/V, so a recomputed entry is a new entry).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from kvstreams.errors import KVStreamsError

RecallHow = Literal["archive", "recompute"]
RECALL_HOWS = ("archive", "recompute")
RecallTrigger = Literal["observation", "model"]
RECALL_TRIGGERS = ("observation", "model")


def words(text: str) -> set[str]:
    """Lower-case alphanumeric words of ``text`` (markup and punctuation dropped)."""
    return set(re.findall(r"[a-z0-9]+", text.lower()))


@dataclass(frozen=True)
class Recall:
    """Which deleted units come back before an observation joins the context."""

    name: ClassVar[str] = "base"
    max_units: int = 1  # most units recalled for one observation
    max_tokens: int = 96  # a unit longer than this is never recalled (what recall may add to the KV)
    how: RecallHow = "archive"
    trigger: RecallTrigger = "observation"  # what the deleted units are matched against
    tag: str = "recall"  # trigger "model": the element the policy writes its query in

    def __post_init__(self) -> None:
        if self.max_units < 1 or self.max_tokens < 1:
            raise KVStreamsError(f"{self.name} recall: max_units and max_tokens must be >= 1")
        if self.how not in RECALL_HOWS:
            raise KVStreamsError(f"recall how {self.how!r}: choose one of {', '.join(RECALL_HOWS)}")
        if self.trigger not in RECALL_TRIGGERS:
            raise KVStreamsError(
                f"recall trigger {self.trigger!r}: choose one of {', '.join(RECALL_TRIGGERS)}"
            )
        if not re.fullmatch(r"[A-Za-z][\w-]*", self.tag):
            raise KVStreamsError(
                f"recall tag {self.tag!r}: a name such as 'recall' (letters, digits, _ or -)"
            )

    def query(self, observation: str, reply: str) -> str | None:
        """The text the deleted units are matched against when ``observation`` is about to join the
        context after ``reply``: the observation, or what the reply wrote inside the tag (its last
        such span); None: nothing is recalled."""
        if self.trigger == "observation":
            return observation
        asked = self._requests().findall(reply)
        return asked[-1] if asked else None

    def content(self, unit: str) -> str:
        """A deleted unit's text as it is matched: without the queries it wrote (a reply that asked for
        "the color" is not what the next request for "the color" wants back)."""
        return self._requests().sub(" ", unit) if self.trigger == "model" else unit

    def _requests(self) -> re.Pattern[str]:
        return re.compile(rf"<{self.tag}>(.*?)</{self.tag}>", flags=re.DOTALL)

    def choose(self, deleted: list[str], query: str) -> list[int]:
        """Indices into ``deleted`` (the deleted units' texts, oldest first) to bring back for
        ``query`` (the observation, or the policy's request: :meth:`query`)."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        keys = ("max_units", "max_tokens", "how") + (("trigger", "tag") if self.trigger == "model" else ())
        return {"name": self.name, **{k: getattr(self, k) for k in keys}}


@dataclass(frozen=True)
class LexicalRecall(Recall):
    """The deleted units sharing the most informative words with the query (IDF-weighted
    overlap, ``log(N / df)`` over the N deleted units), those scoring at least ``min_score``."""

    name: ClassVar[str] = "lexical"
    min_score: float = 1.0  # at least one shared word that fewer than N / e deleted units hold

    def choose(self, deleted: list[str], query: str) -> list[int]:
        if not deleted:
            return []
        docs = [words(d) for d in deleted]
        asked = words(query)
        df = {w: sum(w in d for d in docs) for w in asked}
        idf = {w: math.log(len(docs) / n) for w, n in df.items() if n}
        scores = [sum(idf.get(w, 0.0) for w in asked & d) for d in docs]
        ranked = sorted(range(len(docs)), key=lambda i: (-scores[i], -i))  # ties: the newest
        return sorted(i for i in ranked[: self.max_units] if scores[i] >= self.min_score)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "min_score": self.min_score}


RECALLS: dict[str, type[Recall]] = {"lexical": LexicalRecall}


def check_mode(recall: Recall | None, mode: str) -> None:
    """Refuse a recall the episodes' compaction ``mode`` cannot carry out."""
    if recall is None:
        return
    if mode == "full":
        raise KVStreamsError("recall brings back what compaction deleted: mode 'full' deletes nothing")
    if mode == "reprefill" and recall.how == "archive":
        raise KVStreamsError(
            "recall how 'archive' restores K/V in the one continuous cache of mode 'stream'; "
            "re-prefill keeps no K/V across segments: use how = 'recompute'"
        )


def make_recall(name: str, **kwargs: Any) -> Recall:
    if name not in RECALLS:
        raise KVStreamsError(f"unknown recall {name!r}; choose one of {', '.join(sorted(RECALLS))}")
    try:
        return RECALLS[name](**kwargs)
    except TypeError as err:
        raise KVStreamsError(f"recall {name!r}: {err}") from None

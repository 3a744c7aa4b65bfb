"""Registries by name (policies, compaction strategies, environments), with clear errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from kvstreams.errors import KVStreamsError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: make ``cls`` available as ``name`` (and set ``cls.name``)."""

        def wrap(cls: type[T]) -> type[T]:
            cls.name = name  # type: ignore[attr-defined]
            self.entries[name] = cls
            return cls

        return wrap

    def make(self, name: str, **options: Any) -> T:
        """An instance of ``name`` with ``options`` (None values mean: the default)."""
        if name not in self.entries:
            raise KVStreamsError(
                f"unknown {self.kind} {name!r}; available: {', '.join(sorted(self.entries))}"
            )
        cls = self.entries[name]
        fields = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
        unknown = sorted(set(options) - fields)
        if unknown:
            raise KVStreamsError(
                f"{self.kind} {name!r} has no option(s) {', '.join(unknown)}; it takes {', '.join(sorted(fields))}"
            )
        return cls(**{k: v for k, v in options.items() if v is not None})

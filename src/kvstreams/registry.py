"""Registries by name (policies, compaction strategies, environments), with clear errors."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
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
        options = {k: v for k, v in options.items() if v is not None}
        hints = typing.get_type_hints(cls)
        for key, value in options.items():
            problem = _type_problem(hints.get(key), value)
            if problem:
                raise KVStreamsError(f"{self.kind} {name!r}: option {key} = {value!r} {problem}")
        return cls(**options)


def _type_problem(hint: Any, value: Any) -> str | None:
    """Why ``value`` does not fit a simple annotation (int, float, str, bool, or one of them or None);
    None when it fits or the annotation is not a simple one. bool is not taken for a number."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) != 1:
            return None
        hint = inner[0]
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        return "is not an integer"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "is not a number"
        if not math.isfinite(value):
            return "is not finite"
    if hint is str and not isinstance(value, str):
        return "is not a string"
    if hint is bool and not isinstance(value, bool):
        return "is not true or false"
    return None

"""The one progress bar of the command line, training and the benchmarks (rich), and the console the
commands print their tables to.

On a terminal it draws a bar; elsewhere (CI logs, pipes) it draws nothing, and the benchmarks print
one line per run instead (:func:`kvstreams.bench.report.progress_bar`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Bar:
    """A running bar: :meth:`advance` it, or :meth:`update` its position, description or live figures."""

    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)

    def update(
        self, completed: int | None = None, description: str | None = None, info: str | None = None
    ) -> None:
        fields = {} if info is None else {"info": info}
        self._progress.update(self._task, completed=completed, description=description, **fields)


@contextmanager
def progress(
    description: str, total: int | None, start: int = 0, transient: bool = True, info: bool = False
) -> Iterator[Bar]:
    """A bar over ``total`` steps (None: unknown) from ``start``; ``info`` adds a column of live figures
    (:meth:`Bar.update`); ``transient`` removes the bar when done."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    if info:
        columns.append(TextColumn("{task.fields[info]}"))
    with Progress(*columns, transient=transient, disable=not sys.stderr.isatty()) as bar:
        yield Bar(bar, bar.add_task(description, total=total, completed=start, info=""))


def console(width: int = 132):
    """A console at least ``width`` columns wide: tables stay readable when piped or captured."""
    from rich.console import Console

    return Console(width=max(Console().width, width))


@contextmanager
def training_bar(total: int, start: int):
    """The training bar, with the live figures; yields ``update(step, metrics)``."""
    with progress("train", total, start, transient=False, info=True) as bar:

        def update(step: int, m: dict[str, float]) -> None:
            info = (
                f"reward {m.get('reward/mean', 0):.3f}  mismatch k3 {m.get('mismatch/k3_kl', 0):.1e}  "
                f"{m.get('tokens/s', 0):.0f} tok/s"
            )
            bar.update(completed=step, info=info)

        yield update

"""What every benchmark shares: the machine record, peak-memory probes, tables, JSON and targets."""

from __future__ import annotations

import os
import platform
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstreams.atomic import write_json


def machine_info() -> dict[str, Any]:
    """CPU model, cores, accelerator and library versions: absolute figures mean nothing without it."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        found = re.search(r"model name\s*:\s*(.+)", text)
        if found:
            cpu = found.group(1).strip()
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# --- peak memory ---------------------------------------------------------------------------------------
def _status_bytes(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"{key}:\s+(\d+) kB", text)
    return int(found.group(1)) * 1024 if found else 0


@dataclass
class Peak:
    """Peak memory above the level at entry: resident set on CPU, allocated memory on CUDA."""

    kind: str = "rss"
    base: int = 0
    peak: int = 0

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


def peak_memory_supported(device: str = "cpu") -> bool:
    if device.startswith("cuda"):
        return torch.cuda.is_available()
    return Path("/proc/self/clear_refs").exists()


_LIBC = None


def pin_allocator() -> None:
    """Make glibc hand large blocks back to the system when they are freed (a fixed mmap threshold),
    so that the resident high-water mark of a block measures that block's own allocations. Called
    once when a benchmark starts, before the models are loaded."""
    global _LIBC
    if _LIBC is not None:
        return
    try:
        import ctypes

        _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, no dynamic raising
        _LIBC.mallopt(-1, 0)  # M_TRIM_THRESHOLD: trim the heap top eagerly
    except (OSError, AttributeError):
        _LIBC = False


def _release_free_memory() -> None:
    """Return freed heap pages to the system, so that reusing them shows in the resident set again."""
    pin_allocator()
    if _LIBC:
        _LIBC.malloc_trim(0)


def available_memory() -> int | None:
    """Bytes the system can still give (MemAvailable), None where unknown."""
    try:
        found = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


@contextmanager
def measure_peak(device: str = "cpu") -> Iterator[Peak]:
    """Measure the peak memory of the block. On CPU (Linux), the process's resident high-water mark
    is reset on entry (``/proc/self/clear_refs``) and read on exit; large tensors are mmap-backed, so
    the mark follows tensor allocations closely."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        probe = Peak("cuda_allocated", base=torch.cuda.memory_allocated())
        yield probe
        torch.cuda.synchronize()
        probe.peak = torch.cuda.max_memory_allocated()
        return
    _release_free_memory()
    probe = Peak("rss")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: report the lifetime peak
        probe.kind = "rss_lifetime"
    probe.base = _status_bytes("VmRSS")
    yield probe
    probe.peak = _status_bytes("VmHWM")


def timed(fn: Callable[[], Any], repeats: int = 1) -> tuple[float, Any]:
    """Best wall-clock seconds of ``repeats`` calls (the best is the least disturbed by the machine)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


# --- reports ----------------------------------------------------------------------------------------------
@dataclass
class Target:
    """A figure the benchmark is measured against; ``met`` is None where it could not be measured."""

    name: str
    goal: str
    value: str
    met: bool | None


@dataclass
class Section:
    """One table: rows of plain values, with the columns to print (all of them go to JSON)."""

    title: str
    columns: Sequence[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""


@dataclass
class BenchReport:
    bench: str
    settings: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=machine_info)
    sections: list[Section] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def section(self, title: str, columns: Sequence[str], note: str = "") -> Section:
        s = Section(title, list(columns), note=note)
        self.sections.append(s)
        return s

    def as_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "settings": self.settings,
            "machine": self.machine,
            "seconds": round(self.seconds, 1),
            "sections": [
                {"title": s.title, "note": s.note, "columns": list(s.columns), "rows": s.rows}
                for s in self.sections
            ],
            "targets": [t.__dict__ for t in self.targets],
            "plots": self.plots,
        }

    def save(self, path: str | Path) -> Path:
        return write_json(Path(path), self.as_dict())


def fmt(value: Any) -> str:
    """Numbers as a reader wants them in a table: thousands separated, 3 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 0.01:
            return f"{value:.3g}"
        return f"{value:.2e}"
    return str(value)


def print_report(report: BenchReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 160))
    m = report.machine
    console.print(
        f"[bold]kvstreams bench {report.bench}[/bold]: {m['cpu']}, {m['cores']} cores, "
        f"{m['gpu'] or 'no GPU'}, torch {m['torch']}, transformers {m['transformers']} "
        f"({report.seconds:.0f} s)"
    )
    for s in report.sections:
        if not s.rows and not s.note:  # a section this preset does not fill
            continue
        table = Table(title=s.title, title_justify="left")
        for c in s.columns:
            left = c in _TEXT_COLUMNS
            table.add_column(c, justify="left" if left else "right", overflow="fold", no_wrap=left)
        for row in s.rows:
            table.add_row(*(fmt(row.get(c)) for c in s.columns))
        console.print(table)
        if s.note:
            console.print(f"  {s.note}")
    if report.targets:
        table = Table(title="targets", title_justify="left")
        for c in ("target", "goal", "measured", "met"):
            table.add_column(c)
        for t in report.targets:
            met = "n/a" if t.met is None else ("[green]yes[/green]" if t.met else "[red]no[/red]")
            table.add_row(t.name, t.goal, t.value, met)
        console.print(table)
    for p in report.plots:
        console.print(f"plot: {p}")


def save_figure(fig, path: Path) -> str:
    """Lay out, write (PNG, 120 dpi) and close a matplotlib figure; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


_TEXT_COLUMNS = {"model", "env", "strategy", "mode", "backend", "engine", "policy", "track", "method", "what"}


@contextmanager
def progress_bar(total: int) -> Iterator[Callable[[str], None]]:
    """Progress over a benchmark's runs; the callable names the run starting now and advances.

    A bar on a terminal; otherwise (CI logs, pipes) one line per run on stderr, with the time so far.
    """
    import sys

    from kvstreams.progress import progress

    interactive = sys.stderr.isatty()
    started = time.perf_counter()
    count = [0]
    with progress("starting", total) as bar:

        def step(description: str) -> None:
            if count[0]:
                bar.advance()
            count[0] += 1
            bar.update(description=description)
            if not interactive:
                elapsed = time.perf_counter() - started
                print(
                    f"[{count[0]}/{total}] {description} ({elapsed:.0f} s so far)",
                    file=sys.stderr,
                    flush=True,
                )

        yield step
        bar.advance()

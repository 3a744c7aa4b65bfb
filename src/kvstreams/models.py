"""Loading local Hugging Face causal LMs (tiny ones are made by ``kvstreams.tiny``).

Supported families: Llama, Qwen2, Qwen3 and Mistral (GQA included). Models are only ever read from
a local directory (``local_files_only=True``); nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstreams.errors import KVStreamsError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry the engine and the trace need to know about."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int


def model_shape(model: torch.nn.Module) -> ModelShape:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelShape(
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
    )


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise KVStreamsError(f"unknown dtype {name!r}; choose one of {', '.join(table)}")
    return table[name]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_REQUIRED_INTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def _check_config(config: object, config_file: Path) -> None:
    """The config keys kvstreams relies on: present, positive integers, heads that divide."""
    if not isinstance(config, dict):
        raise KVStreamsError(f"{config_file} is not a JSON object")
    for key in (*_REQUIRED_INTS, "num_key_value_heads"):
        value = config.get(key)
        if value is None and key == "num_key_value_heads":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KVStreamsError(f"{config_file}: {key} must be a positive integer, got {value!r}")
    heads, kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads") or config["num_attention_heads"],
    )
    if heads % kv:
        raise KVStreamsError(
            f"{config_file}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})"
        )


def _check_weights(path: Path, model: torch.nn.Module, info: dict) -> None:
    """Every weight read from the directory and finite: transformers would initialise a missing tensor
    at random (and drop an unexpected one) with a warning kvstreams silences, so a model with a
    hole would train without a word."""
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        names = sorted(str(k) for k in (info.get(kind) or []))
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise KVStreamsError(f"{path}: {kind.replace('_keys', '')} weights in model.safetensors: {shown}")
    bad = first_nonfinite(model)
    if bad is not None:
        raise KVStreamsError(f"{path}: non-finite (NaN or inf) weights in {bad}")


def first_nonfinite(model: torch.nn.Module) -> str | None:
    """The name of the first parameter holding a NaN or inf, or None."""
    return next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None)


def quiet_transformers() -> None:
    """No transformers warnings or download bars on the commands' output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def check_attention(model) -> None:
    """Refuse a model whose attention does not hand its layers to kvstreams' contexts (the sampler's
    steps would never run: it must be loaded with :func:`load_model`)."""
    if getattr(model.config, "_attn_implementation", None) != "kvstreams":
        raise KVStreamsError(
            "the model must be loaded with kvstreams.models.load_model (kvstreams attention)"
        )


def check_positions(model, longest: int, what: str) -> None:
    """Refuse, before sampling, sequences longer than the model's positions (RoPE tables end there)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise KVStreamsError(f"{what} = {longest} exceeds the model's max_position_embeddings ({limit})")


def _check_directory(path: Path) -> None:
    """Refuse, before transformers reads it, a directory that is not a supported causal LM with a
    tokenizer: one line naming what is wrong."""
    config_file = path / "config.json"
    if not path.is_dir():
        raise KVStreamsError(f"model directory {str(path)!r} does not exist")
    if not config_file.is_file():
        raise KVStreamsError(f"{str(path)!r} is not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise KVStreamsError(f"cannot read {config_file}: {err}") from None
    if not isinstance(config, dict):
        raise KVStreamsError(f"{config_file} is not a JSON object")
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise KVStreamsError(
            f"model type {model_type!r} in {path} is not supported; kvstreams supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} causal LMs"
        )
    if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
        raise KVStreamsError(f"{path} holds {architectures[0]}, not a causal LM (…ForCausalLM)")
    _check_config(config, config_file)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise KVStreamsError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load a local causal LM and its tokenizer, with kvstreams' attention function installed.

    The model keeps behaving like the original one for ordinary calls (the attention function falls
    back to SDPA); only calls that carry a kvstreams attention context take the engine or replay path.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvstreams.attention import install

    path = Path(model_dir)
    _check_directory(path)
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise KVStreamsError(f"device {device!r} requested but no CUDA device is available")
    install()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            dtype=_dtype(dtype),
            attn_implementation="kvstreams",
            output_loading_info=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers and safetensors raise many kinds for a broken directory
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise KVStreamsError(f"cannot load model from {path}: {type(err).__name__}: {first_line}") from None
    _check_weights(path, model, info)
    if len(tokenizer) > model.config.vocab_size:
        raise KVStreamsError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only "
            f"{model.config.vocab_size}: ids beyond it would index outside the embeddings"
        )
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        # Mistral-style sliding windows are one more visibility rule; until the engine records them in
        # `death`, refuse instead of replaying something the sampler did not see.
        window = model.config.sliding_window
        if window < model.config.max_position_embeddings:
            raise KVStreamsError(
                f"{path} uses sliding-window attention (window {window}); kvstreams does not model it yet"
            )
    model.to(device)
    model.eval()
    return model, tokenizer

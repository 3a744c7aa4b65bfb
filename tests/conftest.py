"""Shared fixtures: tiny models are made once per test session (a few seconds each)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvstreams.models import load_model
from kvstreams.tiny import make_tiny_model

# `make test` runs two pytest workers (pytest-xdist) on a 2-core machine: one torch thread each
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch)) for arch in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def two_steps(model_dirs, tmp_path_factory):
    """A finished 2-step training run with both checkpoints kept (the reliability tests copy it)."""
    from kvstreams.loop import train
    from test_train import small_config

    root = tmp_path_factory.mktemp("two_steps")
    cfg = small_config(model_dirs["qwen3"], root, **{"train.eval_every": "0", "train.keep_last": "2"})
    train(cfg, show_progress=False)
    return root


@pytest.fixture(scope="session")
def models(model_dirs):
    """arch -> (model, tokenizer); qwen3 is GQA with q/k norm, llama is multi-head."""
    torch.set_num_threads(THREADS)
    return {arch: load_model(path) for arch, path in model_dirs.items()}


@pytest.fixture(scope="session")
def qwen(models):
    return models["qwen3"]


def random_prompts(n: int, lengths: int | list[int], seed: int = 0, vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if isinstance(lengths, int):
        lengths = [lengths] * n
    return [torch.randint(5, vocab, (length,), generator=g).tolist() for length in lengths]


# The project's shared data sits beside the repository (CI lays a copy of shared/ there).
GSM8K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture(scope="session")
def gsm8k_path() -> str:
    if not GSM8K.is_file():
        pytest.skip(f"GSM8K copy not found at {GSM8K}")
    return str(GSM8K)


@pytest.fixture(scope="session")
def gsm8k_train_path(gsm8k_path) -> str:
    train = Path(gsm8k_path).with_name("train.jsonl")
    if not train.is_file():
        pytest.skip(f"GSM8K train split not found at {train}")
    return str(train)

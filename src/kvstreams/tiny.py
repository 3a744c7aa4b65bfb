"""Tiny models for tests, the demo and benchmarks: a locally trained tokenizer and a seeded HF model.

Nothing is downloaded: the tokenizer is trained on a built-in corpus of ``WORDS`` and the model is a
randomly initialised Llama, Qwen2, Qwen3 or Mistral written to a local directory that
``kvstreams.models.load_model`` reads like any other.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

import torch

from kvstreams.errors import KVStreamsError
from kvstreams.words import WORDS

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")


def _corpus(rng: random.Random, n_lines: int = 4000) -> list[str]:
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, n), str(rng.randint(0, 9999)))
        line = " ".join(words)
        if rng.random() < 0.3:
            line = f"<action>{line}</action>"
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ":", ","]))
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0, extra_texts: list[str] | None = None):
    """A byte-level BPE tokenizer trained on a built-in corpus, saved-ready as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise KVStreamsError("--vocab must be at least 300 (256 bytes + special tokens + merges)")
    rng = random.Random(seed)
    texts = _corpus(rng) + list(extra_texts or [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )


Arch = Literal["llama", "qwen2", "qwen3", "mistral"]
ARCHS = ("qwen3", "llama", "qwen2", "mistral")


def _check_shape(arch: str, layers: int, hidden: int, heads: int, kv_heads: int | None) -> int:
    """Refuse a shape the config classes would not build; the number of KV heads (its default: heads
    for llama, heads / 2 otherwise)."""
    if arch not in ARCHS:
        raise KVStreamsError(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if kv_heads is None:
        kv_heads = heads if arch == "llama" else max(1, heads // 2)
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv-heads", kv_heads)):
        if value < 1:
            raise KVStreamsError(f"--{name} must be positive, got {value}")
    if hidden % heads:
        raise KVStreamsError(f"--hidden ({hidden}) must be divisible by --heads ({heads})")
    if heads % kv_heads:
        raise KVStreamsError(f"--heads ({heads}) must be divisible by --kv-heads ({kv_heads})")
    return kv_heads


def write_tiny_model(out_dir: str | Path, force: bool = False, **shape) -> Path:
    """``kvstreams tiny-model``: :func:`make_tiny_model` into ``out_dir``, refusing to overwrite a model
    there unless ``force``."""
    from kvstreams.atomic import ensure_writable

    if (Path(out_dir) / "config.json").exists() and not force:
        raise KVStreamsError(f"--out {str(out_dir)!r} already holds a model; pass --force to overwrite it")
    from kvstreams.models import quiet_transformers

    ensure_writable(Path(out_dir), "--out")
    quiet_transformers()
    return make_tiny_model(out_dir, **shape)


def make_tiny_model(
    out_dir: str | Path,
    arch: Arch = "qwen3",
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int | None = None,
    vocab: int = 512,
    seed: int = 0,
    init_std: float = 0.08,
) -> Path:
    """Write a randomly initialised (seeded) HF model directory with a locally trained tokenizer.

    The default qwen3 model uses GQA (2 KV heads for 4 query heads) and q/k norm; llama defaults to
    multi-head attention; qwen2 (q/k/v biases) and mistral use GQA, without sliding windows.
    ``init_std`` is larger than the usual 0.02 so that attention is peaked
    enough for eviction to change the model's predictions measurably.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    kv_heads = _check_shape(arch, layers, hidden, heads, kv_heads)
    tokenizer = train_tokenizer(vocab, seed=seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=32768,
        initializer_range=init_std,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "mistral":
        config = MistralConfig(**common, sliding_window=None)
    else:
        config = LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

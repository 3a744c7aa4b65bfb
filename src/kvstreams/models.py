"""Loading local Hugging Face causal LMs, and making the tiny ones tests and the demo use.

Supported families: Llama, Qwen2, Qwen3 and Mistral (GQA included). Models are only ever read from
a local directory (``local_files_only=True``); nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from kvstreams.errors import KVStreamsError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

# Words for the tokenizer's training corpus and the synthetic prompt source. Environments add theirs.
WORDS = [
    "the",
    "a",
    "an",
    "and",
    "or",
    "but",
    "if",
    "then",
    "else",
    "when",
    "while",
    "of",
    "to",
    "in",
    "on",
    "at",
    "by",
    "for",
    "with",
    "from",
    "into",
    "over",
    "under",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "has",
    "have",
    "had",
    "do",
    "does",
    "did",
    "will",
    "would",
    "can",
    "could",
    "should",
    "may",
    "might",
    "must",
    "i",
    "you",
    "he",
    "she",
    "it",
    "we",
    "they",
    "me",
    "him",
    "her",
    "us",
    "them",
    "my",
    "your",
    "his",
    "its",
    "our",
    "their",
    "this",
    "that",
    "these",
    "those",
    "what",
    "which",
    "who",
    "whom",
    "whose",
    "where",
    "why",
    "how",
    "all",
    "any",
    "both",
    "each",
    "few",
    "more",
    "most",
    "other",
    "some",
    "such",
    "no",
    "not",
    "only",
    "own",
    "same",
    "so",
    "than",
    "too",
    "very",
    "just",
    "now",
    "here",
    "there",
    "up",
    "down",
    "out",
    "off",
    "again",
    "once",
    "key",
    "door",
    "room",
    "box",
    "table",
    "chest",
    "kitchen",
    "garden",
    "hall",
    "north",
    "south",
    "east",
    "west",
    "go",
    "take",
    "drop",
    "open",
    "close",
    "look",
    "read",
    "remember",
    "recall",
    "fact",
    "answer",
    "question",
    "number",
    "color",
    "red",
    "blue",
    "green",
    "yellow",
    "black",
    "white",
    "apple",
    "book",
    "lamp",
    "coin",
    "map",
    "note",
    "code",
    "secret",
    "name",
    "value",
    "first",
    "second",
    "third",
    "last",
    "step",
    "turn",
    "think",
    "summary",
    "keep",
    "delete",
    "memory",
    "state",
    "agent",
    "task",
    "reward",
    "score",
    "win",
    "lose",
    "done",
    "yes",
    "ok",
    "because",
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "plus",
    "minus",
    "times",
    "equals",
    "total",
]


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry the engine and the trace need to know about."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


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


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load a local causal LM and its tokenizer, with kvstreams' attention function installed.

    The model keeps behaving like the original one for ordinary calls (the attention function falls
    back to SDPA); only calls that carry a kvstreams attention context take the engine or replay path.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvstreams.attention import install

    path = Path(model_dir)
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
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise KVStreamsError(f"device {device!r} requested but no CUDA device is available")
    install()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=_dtype(dtype), attn_implementation="kvstreams"
        )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers and safetensors raise many kinds for a broken directory
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise KVStreamsError(f"cannot load model from {path}: {type(err).__name__}: {first_line}") from None
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


# ----------------------------------------------------------------------------------------------------
# Tiny models


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

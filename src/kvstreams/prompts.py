"""Built-in synthetic prompt source: chat-formatted prompts of an exact token length.

Used by ``kvstreams rollout`` / ``verify`` when no environment is given. The body is seeded random
text from the tiny tokenizer's vocabulary of words, so prompts look like text to any tokenizer.
"""

from __future__ import annotations

import random

from kvstreams.errors import KVStreamsError
from kvstreams.words import WORDS


def _chat_ids(tokenizer, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def synthetic_prompts(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` tokens: chat header, random words, assistant turn opener."""
    if n < 1:
        raise KVStreamsError(f"need at least one prompt, got {n}")
    empty = _chat_ids(tokenizer, "")
    if length <= len(empty):
        raise KVStreamsError(
            f"--prompt-len must exceed the chat template's own {len(empty)} tokens, got {length}"
        )
    # Split the empty rendering around the content: everything up to the first token that changes.
    probe = _chat_ids(tokenizer, "x")
    head_len = next(i for i, (a, b) in enumerate(zip(empty, probe, strict=False)) if a != b)
    head, tail = empty[:head_len], empty[head_len:]
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        body: list[int] = []
        need = length - len(head) - len(tail)
        while len(body) < need:
            text = " ".join(rng.choice(WORDS) for _ in range(32))
            body.extend(tokenizer.encode(" " + text, add_special_tokens=False))
        prompts.append(head + body[:need] + tail)
    return prompts

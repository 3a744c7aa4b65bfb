"""Issue #29's `torch.compile` lever, measured: SmolLM2 decode through the engine eager, then with the
model wrapped in ``torch.compile(dynamic=True)`` (the engine's attention context stays Python, so
Dynamo breaks the graph there and compiles the layers' pieces around it). Same prompts, same seed,
side by side in one process; prints tokens/s (prefill included, best of two after warm-up) and
whether the sampled tokens and log-probs are unchanged.

    make real-model && python scripts/compile_lever.py 8 32
"""

from __future__ import annotations

import sys
import time

import torch

from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.models import load_model
from kvstreams.pretrained import model_directory


def _gap(a, b) -> float:
    """Largest |difference| of two traces' sampler log-probs over the sampled tokens."""
    sampled = a.sampled_mask.bool()
    return (a.sampler_logprobs[sampled] - b.sampler_logprobs[sampled]).abs().max().item()


def best_of_two(engine: RolloutEngine, prompts, params) -> tuple[float, list]:
    times, traces = [], []
    for _ in range(2):
        t = time.perf_counter()
        traces = engine.generate(prompts, params)
        times.append(time.perf_counter() - t)
    return min(times), traces


def main(batches: list[int], new_tokens: int = 32) -> None:
    model, tokenizer = load_model(model_directory("smollm2"))
    compiled = RolloutEngine(torch.compile(model, dynamic=True), tokenizer)
    eager = RolloutEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=new_tokens, seed=0, stop_token_ids=())
    for batch in batches:
        prompts = [
            torch.randint(100, 40000, (128,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(batch)
        ]
        t = time.perf_counter()
        compiled.generate(prompts, params)  # compiles (and recompiles for this batch's shapes)
        warmup = time.perf_counter() - t
        eager.generate(prompts, params)
        s_eager, a = best_of_two(eager, prompts, params)
        s_comp, b = best_of_two(compiled, prompts, params)
        same = all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
        diff = max(_gap(x, y) for x, y in zip(a, b, strict=True))
        n = batch * new_tokens
        print(
            f"batch {batch}: eager {n / s_eager:.1f} tok/s, compiled {n / s_comp:.1f} tok/s "
            f"({s_eager / s_comp:.2f}x; first compiled call {warmup:.0f} s); same tokens {same}, "
            f"max |d log p| {diff:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [8, 32])

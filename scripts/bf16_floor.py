"""Issue #29's batch-invariance question, first steps: is the sampler/learner floor (nothing evicted)
the linear layers' or the attention's doing? A matrix multiply on this CPU gives a row different bits
depending on how many rows share the call (decode: the batch; the learner: the whole trace);
computing every ``nn.Linear`` in fixed, zero-padded 64-row tiles makes a row's result independent of
the call (checked bit for bit here at SmolLM2's shapes, first line of the output). The fused
attention computes in the model's dtype; ``fp32_sdpa`` computes it in float32 on both sides. This
script samples 4 sequences with the engine (full KV, 48 new tokens), replays them, and prints the
largest |Δ log p| per variant and dtype (docs/benchmarks.md, "bf16 floor"):

    make real-model && python scripts/bf16_floor.py float32 bfloat16
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.nn.functional as F

from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.models import load_model
from kvstreams.pretrained import model_directory
from kvstreams.replay import replay_logprobs
from kvstreams.verify import Agreement

TILE = 64
_LINEAR = F.linear


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed in zero-padded tiles of ``TILE`` rows: a row's bits do not depend on the
    other rows of the call."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded = -(-rows // TILE) * TILE
    flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    out = torch.cat([_LINEAR(flat[i : i + TILE], weight, bias) for i in range(0, padded, TILE)])[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


_SDPA = F.scaled_dot_product_attention


def fp32_sdpa(query, key, value, *args, **kwargs):
    """``F.scaled_dot_product_attention`` with its math in float32 (inputs upcast exactly, the output
    rounded back to their dtype): every fused attention of the engine and the replay goes through it.
    The engine's unfused path (``attend_slots``, for policies that need attention statistics) already
    computes in float32."""
    out = _SDPA(query.float(), key.float(), value.float(), *args, **kwargs)
    return out.to(query.dtype)


@contextlib.contextmanager
def attention_as(function):
    F.scaled_dot_product_attention = function
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA


@contextlib.contextmanager
def linear_as(function):
    torch.nn.modules.linear.F.linear = function
    try:
        yield
    finally:
        torch.nn.modules.linear.F.linear = _LINEAR


def tiles_are_invariant(dtype: torch.dtype) -> dict[str, bool]:
    """Per SmolLM2 projection shape (K x N): do rows computed alone, or with 7, 31, 63 or 199 others,
    get the same bits from plain ``F.linear`` and from ``tiled_linear`` as inside a 300-row call?"""
    torch.manual_seed(0)
    found = {}
    for k, n in ((576, 576), (576, 1536), (1536, 576), (576, 49152)):
        weight, x = (torch.randn(n, k) * 0.05).to(dtype), torch.randn(300, k).to(dtype)
        for name, function in (("plain", _LINEAR), ("tiled", tiled_linear)):
            whole = function(x, weight)
            found[f"{name} {k}x{n}"] = all(
                torch.equal(function(x[s : s + m], weight), whole[s : s + m])
                for m, s in ((1, 0), (1, 77), (8, 5), (32, 100), (64, 3), (200, 17))
            )
    return found


def main(dtypes: list[str]) -> None:
    for dtype in dtypes:
        print(dtype, "rows' bits independent of the call:", tiles_are_invariant(getattr(torch, dtype)))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (60, 90, 120, 128)]
    params = SamplingParams(max_new_tokens=48, seed=0, stop_token_ids=())
    for dtype in dtypes:
        model, tokenizer = load_model(model_directory("smollm2"), dtype=dtype)
        variants = (
            ("plain", _LINEAR, None),
            ("tiled linear", tiled_linear, None),
            ("fp32 attention", _LINEAR, fp32_sdpa),
            ("tiled + fp32 attention", tiled_linear, fp32_sdpa),
        )
        for label, function, attention in variants:
            if attention is not None and dtype == "float32":
                continue
            with linear_as(function), attention_as(attention) if attention else contextlib.nullcontext():
                t = time.perf_counter()
                traces = RolloutEngine(model, tokenizer).generate(prompts, params)
                sampled = time.perf_counter() - t
                agreement = Agreement.measure(traces, replay_logprobs(model, traces))
            print(
                f"{dtype:9s} {label:22s} max |Δ log p| {agreement.max_abs_diff:.3g} "
                f"(sampling {sampled:.1f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["float32", "bfloat16"])

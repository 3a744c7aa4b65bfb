"""flex_attention replay (compiled on CPU, about 30 s) agrees with the SDPA reference and the sampler."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.policies import make_policy
from kvstreams.replay import replay_logprobs

pytestmark = pytest.mark.flex


def test_flex_matches_sdpa_and_sampler(qwen):
    model, tok = qwen
    engine = RolloutEngine(model, tok, make_policy("snapkv", budget=128))
    traces = engine.generate(
        random_prompts(3, [150, 40, 90], seed=2),
        SamplingParams(max_new_tokens=200, seed=1, stop_token_ids=()),
    )
    assert tuple(traces[0].death.shape)[1] > 1  # per-head record exercised
    for packed in (False, True):
        for mode in ("shadow", "dense"):
            flex = replay_logprobs(model, traces, mode=mode, backend="flex", packed=packed)
            sdpa = replay_logprobs(model, traces, mode=mode, backend="sdpa", packed=packed)
            for f, s, t in zip(flex, sdpa, traces, strict=True):
                m = t.sampled_mask
                assert torch.allclose(f[m], s[m], atol=2e-5)
                if mode == "shadow":
                    assert (f[m] - t.sampler_logprobs[m]).abs().max() <= 1e-4

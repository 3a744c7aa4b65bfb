"""The core claim: the learner's replay reproduces the sampler's log-probs exactly, for every policy,
on GQA and multi-head models, while a dense (naive) learner does not."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.errors import KVStreamsError
from kvstreams.policies import POLICIES, make_policy
from kvstreams.replay import replay_logprobs
from kvstreams.verify import Agreement

EVICTING = sorted(n for n in POLICIES if n != "full")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("policy_name", EVICTING)
def test_shadow_replay_matches_sampler(models, arch, policy_name):
    model, tok = models[arch]
    engine = RolloutEngine(model, tok, make_policy(policy_name))
    prompts = random_prompts(3, [64, 72, 80], seed=1)
    traces = engine.generate(prompts, SamplingParams(max_new_tokens=448, seed=7, stop_token_ids=()))

    assert all(len(t) >= 512 for t in traces)
    assert min(engine.last_stats.eviction_events) >= 3
    assert all(t.n_evicted > 0 for t in traces)

    shadow = Agreement.measure(traces, replay_logprobs(model, traces, mode="shadow"))
    dense = Agreement.measure(traces, replay_logprobs(model, traces, mode="dense"))
    assert shadow.max_abs_diff <= 1e-4
    assert dense.max_abs_diff > 0.05
    assert dense.max_abs_diff > 1000 * shadow.max_abs_diff
    assert abs(shadow.kl_k3) < 1e-8 < dense.kl_k3


@pytest.mark.parametrize("policy_name", EVICTING)
def test_in_float64_sampler_and_learner_agree_to_the_record_storage(qwen, policy_name):
    """The replay logic is exact: with sampler and learner both in float64, the only difference left
    is the float32 storage of the recorded log-prob (a wrong visibility shows up as 1e-2 or more)."""
    import copy

    model = copy.deepcopy(qwen[0]).double()
    engine = RolloutEngine(model, qwen[1], make_policy(policy_name, budget=0.4))
    traces = engine.generate(
        random_prompts(2, 48, seed=3), SamplingParams(max_new_tokens=160, stop_token_ids=())
    )
    assert min(engine.last_stats.eviction_events) >= 2
    shadow = Agreement.measure(traces, replay_logprobs(model, traces))
    assert shadow.max_abs_diff <= 2e-6  # |log p| < 20 stored in float32: at most ~1.2e-6 off
    assert Agreement.measure(traces, replay_logprobs(model, traces, mode="dense")).max_abs_diff > 0.05


def test_full_cache_engine_equals_plain_forward(qwen):
    """With nothing evicted, both learners agree with the sampler (the engine itself is exact)."""
    model, tok = qwen
    engine = RolloutEngine(model, tok, make_policy("full"))
    traces = engine.generate(
        random_prompts(2, [40, 57]), SamplingParams(max_new_tokens=100, seed=3, stop_token_ids=())
    )
    assert all(t.n_evicted == 0 for t in traces)
    for mode in ("shadow", "dense"):
        agreement = Agreement.measure(traces, replay_logprobs(model, traces, mode=mode))
        assert agreement.max_abs_diff <= 1e-4
    # and the dense replay equals a plain HF forward without kvstreams in the way
    t = traces[0]
    with torch.no_grad():
        logits = model(t.tokens[None]).logits[0]
    plain = torch.log_softmax(logits[:-1], -1).gather(-1, t.tokens[1:, None]).squeeze(-1)
    replayed = replay_logprobs(model, [t], mode="dense")[0][1:]
    assert torch.allclose(plain, replayed, atol=1e-5)


def test_padded_and_packed_replay_agree(qwen):
    model, tok = qwen
    engine = RolloutEngine(model, tok, make_policy("snapkv", budget=96))
    traces = engine.generate(
        random_prompts(3, [30, 120, 64], seed=4),
        SamplingParams(max_new_tokens=150, seed=2, stop_token_ids=()),
    )
    padded = replay_logprobs(model, traces, packed=False)
    packed = replay_logprobs(model, traces, packed=True)
    for a, b, t in zip(padded, packed, traces, strict=True):
        m = t.sampled_mask
        assert torch.allclose(a[m], b[m], atol=1e-5)
        assert (a[m] - t.sampler_logprobs[m]).abs().max() <= 1e-4


@pytest.mark.parametrize("mode", ["shadow", "dense"])
def test_left_padded_rows_replay_like_rows_at_column_0(qwen, mode):
    """``collate(offsets=...)``, the layout of trainers that left-pad prompts (the TRL plug-in): trace
    i starts at column offsets[i]; the padding before it is seen by no real query."""
    from kvstreams.models import model_shape
    from kvstreams.replay import collate, replay_logits, token_logprobs

    model, tok = qwen
    traces = RolloutEngine(model, tok, make_policy("snapkv", budget=64)).generate(
        random_prompts(2, [40, 70], seed=9), SamplingParams(max_new_tokens=60, seed=3, stop_token_ids=())
    )
    shape = model_shape(model)
    plain = collate(traces, shape.n_layers, shape.n_kv_heads, mode=mode)
    shifted = collate(
        traces, shape.n_layers, shape.n_kv_heads, mode=mode, offsets=[7, 9], width=plain.tokens.shape[1] + 9
    )
    assert not shifted.causal and shifted.spans[0] == (0, 7, len(traces[0]))
    with torch.no_grad():
        expected = token_logprobs(replay_logits(model, plain), plain)
        got = token_logprobs(replay_logits(model, shifted), shifted)
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a[1:], b[1:], atol=1e-5)
    with pytest.raises(KVStreamsError, match="width"):
        collate(traces, shape.n_layers, shape.n_kv_heads, offsets=[7, 9], width=plain.tokens.shape[1])


@pytest.mark.parametrize("backend", ["sdpa", "blocksparse"])
def test_dense_padded_replay_is_plain_causal_attention_without_a_mask(qwen, monkeypatch, backend):
    """Dense mode with one trace per row (the naive learner, re-prefill segments, SMD's teacher) runs
    as SDPA's is_causal: no mask is built, and it equals the packed (masked) dense replay."""
    from kvstreams.replay import replay as replay_module

    model, _ = qwen
    traces = RolloutEngine(model, qwen[1], make_policy("snapkv", budget=64)).generate(
        random_prompts(3, [30, 90, 50], seed=6), SamplingParams(max_new_tokens=80, seed=1, stop_token_ids=())
    )
    packed = replay_logprobs(model, traces, mode="dense", backend=backend, packed=True)

    def no_masks(*args, **kwargs):
        raise AssertionError("a mask was built for plain causal attention")

    monkeypatch.setattr(replay_module.visibility, "dense", no_masks)
    monkeypatch.setattr(replay_module, "block_sparse_attention", no_masks)
    padded = replay_logprobs(model, traces, mode="dense", backend=backend)
    for a, b in zip(padded, packed, strict=True):
        assert torch.allclose(a[1:], b[1:], atol=1e-5)


def test_replay_with_early_stops_and_truncated_sampling(qwen):
    """Sequences of different prompt lengths that stop at different steps, with top-k/top-p sampling."""
    model, tok = qwen
    engine = RolloutEngine(model, tok, make_policy("h2o", budget=64))
    stop = tuple(range(5, 40))  # frequent stop tokens: rows leave the batch at different steps
    traces = engine.generate(
        random_prompts(4, [20, 90, 50, 33], seed=5),
        SamplingParams(max_new_tokens=120, seed=9, temperature=1.3, top_k=40, top_p=0.9, stop_token_ids=stop),
    )
    lengths = [len(t) - int(t.metadata["prompt_len"]) for t in traces]
    assert len(set(lengths)) > 1
    for t in traces:
        last = int(t.tokens[-1])
        assert last in stop or len(t) - int(t.metadata["prompt_len"]) == 120
    agreement = Agreement.measure(traces, replay_logprobs(model, traces))
    assert agreement.max_abs_diff <= 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_families_replay_exactly(tmp_path, arch):
    from kvstreams.models import load_model
    from kvstreams.tiny import make_tiny_model

    model, tok = load_model(make_tiny_model(tmp_path / arch, arch=arch, layers=2))
    engine = RolloutEngine(model, tok, make_policy("snapkv", budget=96))
    traces = engine.generate(
        random_prompts(2, 64, seed=3), SamplingParams(max_new_tokens=200, stop_token_ids=())
    )
    assert all(t.n_evicted > 0 for t in traces)
    shadow = Agreement.measure(traces, replay_logprobs(model, traces))
    dense = Agreement.measure(traces, replay_logprobs(model, traces, mode="dense"))
    assert shadow.max_abs_diff <= 1e-4 < dense.max_abs_diff


def test_bfloat16_replay_is_close(model_dirs):
    """bf16 sampler and learner round differently (one-token decode vs whole-trace forward), but the
    shadow learner stays far closer to the sampler than the dense one."""
    from kvstreams.models import load_model

    model, tok = load_model(model_dirs["qwen3"], dtype="bfloat16")
    engine = RolloutEngine(model, tok, make_policy("h2o"))
    traces = engine.generate(
        random_prompts(2, 64, seed=8), SamplingParams(max_new_tokens=300, stop_token_ids=())
    )
    shadow = Agreement.measure(traces, replay_logprobs(model, traces))
    dense = Agreement.measure(traces, replay_logprobs(model, traces, mode="dense"))
    assert shadow.max_abs_diff <= 0.1 and shadow.mean_abs_diff <= 0.03
    assert dense.mean_abs_diff > 5 * shadow.mean_abs_diff
    assert shadow.kl_k3 < 1e-3 < dense.kl_k3


def test_the_learner_side_does_not_load_the_sampler():
    """Replay and the learner stand on the sampling law (kvstreams.sampling), not on the engine."""
    import subprocess
    import sys

    code = "import sys, kvstreams.replay, kvstreams.train.learner; print([m for m in sys.modules if m.startswith('kvstreams.engine')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

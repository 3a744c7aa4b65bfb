"""Block-sparse masked attention equals the dense-mask reference, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts
from kvstreams.compaction import STRATEGIES, make_strategy
from kvstreams.policies import POLICIES
from kvstreams.replay.blocksparse import block_sparse_attention, key_blocks
from kvstreams.visibility import dense as dense_visibility


def random_death(B: int, H: int, T: int, seed: int) -> torch.Tensor:
    """A valid record: each key visible from itself until a random death, some never evicted, sinks kept."""
    g = torch.Generator().manual_seed(seed)
    j = torch.arange(T)
    death = j + 1 + (torch.rand(B, H, T, generator=g) * (T - j)).long()
    never = torch.rand(B, H, T, generator=g) < 0.2
    death = torch.where(never, torch.full_like(death, T), death)
    death[..., :4] = T  # sinks
    return death.clamp(max=T).to(torch.int32)


def reference(q, k, v, death, scale):
    mask = dense_visibility(death)  # [B, Hd, T, T]
    mask = mask.repeat_interleave(q.shape[1] // mask.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@pytest.mark.parametrize("kernel", ["cpu-flash", "math"])
@pytest.mark.parametrize(
    ("T", "Hq", "Hkv", "Hd", "block", "dtype", "tol"),
    [
        (70, 4, 2, 2, 16, torch.float64, 1e-12),  # per-head record, T not a multiple of the block
        (64, 6, 2, 1, 16, torch.float64, 1e-12),  # one record for all heads
        (200, 4, 4, 4, 32, torch.float32, 1e-5),  # no grouping, float32
    ],
)
def test_block_sparse_matches_the_dense_mask_forward_and_backward(T, Hq, Hkv, Hd, block, dtype, tol, kernel):
    torch.manual_seed(0)
    B, D = 2, 8
    q = torch.randn(B, Hq, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, dtype=dtype, requires_grad=True)
    death = random_death(B, Hd, T, seed=1)
    scale = D**-0.5
    grad = torch.randn(B, Hq, T, D, dtype=dtype)

    want = reference(q, k, v, death, scale)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = block_sparse_attention(q, k, v, death, scale, block_size=block, kernel=kernel)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)

    assert (got - want).abs().max() <= tol
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a - b).abs().max() <= tol * 10


@pytest.mark.parametrize("kernel", ["cpu-flash", "math"])
def test_block_sparse_in_bfloat16_stays_within_bfloat16_rounding_of_the_float64_reference(kernel):
    """The log-sum-exp is kept in float32 for half types (the fused kernel's precision), so bfloat16
    errors are those of bfloat16 inputs and outputs, not of a rounded normaliser."""
    torch.manual_seed(0)
    B, Hq, Hkv, T, D = 1, 4, 2, 300, 16
    q, k, v = (torch.randn(B, h, T, D, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    death = random_death(B, Hkv, T, seed=2)
    grad = torch.randn(B, Hq, T, D, dtype=torch.float64)
    inputs = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    want = reference(*(t.bfloat16().double().requires_grad_() for t in (q, k, v)), death, D**-0.5)
    got = block_sparse_attention(*inputs, death, D**-0.5, block_size=64, kernel=kernel)
    got.backward(grad.bfloat16())
    assert (got.double() - want).abs().max() < 2e-2
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in inputs)


def test_only_visible_key_blocks_are_gathered():
    """A sliding record (each key dies 2 blocks later) leaves at most 3 key blocks per query block,
    one of them fully visible (no mask needed)."""
    T, block = 256, 32
    death = (torch.arange(T) + 2 * block).clamp(max=T).to(torch.int32)[None, None]
    keys = key_blocks(death, block)[0][0]
    assert [(len(full) // block, len(partial) // block) for full, partial in keys] == [
        (0, 1),  # the diagonal block is always partial
        (1, 1),  # block 0's keys die at 64: query block 1 (32..63) sees all of them
        (1, 2),  # block 0 dies within query block 2's span (64..95): partial
        *[(1, 2)] * 5,
    ]


def _assert_blocksparse_matches_sdpa(model, traces, packed: bool) -> None:
    """Logits and every parameter gradient of the block-sparse replay within 1e-5 of the dense mask."""
    from kvstreams.models import model_shape
    from kvstreams.replay import collate, replay_logits

    shape = model_shape(model)
    batch = collate(traces, shape.n_layers, shape.n_kv_heads, mode="shadow", packed=packed)

    def logits_and_grads(backend):
        model.zero_grad(set_to_none=True)
        logits = replay_logits(model, batch, backend)
        (logits.float().log_softmax(-1).max(-1).values.mean()).backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, want_grads = logits_and_grads("sdpa")
    got, got_grads = logits_and_grads("blocksparse")
    model.zero_grad(set_to_none=True)
    assert (got - want).abs().max() < 1e-5
    assert len(got_grads) == len(want_grads)
    assert max((a - b).abs().max().item() for a, b in zip(got_grads, want_grads, strict=True)) < 1e-5


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_blocksparse_replay_backend_matches_sdpa_on_every_policys_traces(models, policy_name):
    """Through a whole model on recorded per-head traces (packed, as the CPU learner runs them)."""
    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.policies import make_policy

    model, tok = models["qwen3"]
    params = SamplingParams(max_new_tokens=300, seed=0, stop_token_ids=())
    options = {} if policy_name == "full" else {"budget": 0.5}
    traces = RolloutEngine(model, tok, make_policy(policy_name, **options)).generate(
        random_prompts(2, [40, 57], seed=1), params
    )
    assert policy_name == "full" or all(t.n_evicted > 0 for t in traces)
    _assert_blocksparse_matches_sdpa(model, traces, packed=True)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_blocksparse_replay_backend_matches_sdpa_on_every_strategys_traces(models, strategy):
    """Stream traces of multi-turn episodes with compaction, padded and packed."""
    from kvstreams.engine import SamplingParams
    from kvstreams.envs import make_env
    from kvstreams.episodes import EpisodeRunner

    model, tok = models["qwen3"]
    runner = EpisodeRunner(
        model, tok, make_strategy(strategy), mode="stream", sampling=SamplingParams(seed=0)
    )
    results, _ = runner.run([make_env("memory") for _ in range(2)], [1, 2])
    traces = [t for r in results for t in r.traces]
    assert all(t.n_evicted > 0 for t in traces)
    for packed in (False, True):
        _assert_blocksparse_matches_sdpa(model, traces, packed)

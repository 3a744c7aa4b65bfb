"""Policy registry, budgets, and each policy's choice on hand-made inputs."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from kvstreams.engine.compression import choose_kept
from kvstreams.errors import KVStreamsError
from kvstreams.policies import POLICIES, EntryView, EvictionPolicy, make_policy, parse_budget, register


def view(index: list[int], q: int, budget: int = 8, keys=None, cumulative=None, window=None) -> EntryView:
    idx = torch.tensor(index)[None, None]
    n = idx.shape[-1]
    return EntryView(
        layer=0,
        keys=keys if keys is not None else torch.zeros(1, 1, n, 4),
        index=idx,
        query_index=torch.tensor([q]),
        budget=torch.tensor([budget]),
        attn_cumulative=None if cumulative is None else torch.tensor(cumulative)[None, None],
        attn_window=None if window is None else torch.tensor(window)[None, None],
        generator=torch.Generator().manual_seed(0),
    )


def kept(policy, v: EntryView, target: int) -> list[int]:
    keep = choose_kept(policy, v, torch.tensor([target]), torch.tensor([True]))
    return sorted(v.index[keep].tolist())


# What each policy's module docstring says: the paper it follows, and defaults that must match the code.
DOCUMENTED = {
    "snapkv": (
        "Li et al., 2024",
        {"window 32": ("window", 32), "kernel 7": ("kernel_size", 7), "interval 32": ("interval", 32)},
    ),
    "h2o": (
        "Zhang et al., 2023",
        {"``recent_ratio`` 0.5": ("recent_ratio", 0.5), "``interval`` 1": ("interval", 1)},
    ),
    "streaming_llm": (
        "Xiao et al., 2024",
        {"4 sinks": ("n_sink", 4), "one entry evicted per step": ("interval", 1)},
    ),
    "knorm": ("Devoto et al., 2024", {"interval 16": ("interval", 16)}),
    "random": ("Shadow Mask Distillation paper's ablation", {"interval 16": ("interval", 16)}),
    "recent": ("Shadow Mask Distillation paper's ablation", {"one entry evicted per step": ("interval", 1)}),
    "full": ("never evict", {}),
}


def test_registry_has_the_papers_policies_and_their_docs_state_the_real_defaults():
    builtin = {
        name: cls for name, cls in POLICIES.items() if cls.__module__.startswith("kvstreams.policies.")
    }
    assert set(builtin) == set(DOCUMENTED)  # a new policy states its paper and defaults here too
    for name, cls in builtin.items():
        policy = make_policy(name)
        assert policy.name == name
        doc = " ".join(sys.modules[cls.__module__].__doc__.split())  # the module docstring, one line
        cites, defaults = DOCUMENTED[name]
        assert cites in doc, name
        for phrase, (field, value) in defaults.items():
            assert phrase in doc and getattr(policy, field) == value, (name, phrase)
        if name != "full":
            assert "budget 50% of the context" in doc and policy.budget == 0.5, name


def test_default_budget_is_half_the_context():
    for name in POLICIES:
        if name != "full":
            assert make_policy(name).resolve_budget(1000) == 500


def test_bad_policy_inputs():
    with pytest.raises(KVStreamsError, match="unknown policy 'nope'"):
        make_policy("nope")
    with pytest.raises(KVStreamsError, match="has no option"):
        make_policy("h2o", window=3)
    with pytest.raises(KVStreamsError, match="fractional budget"):
        make_policy("recent", budget=1.5)
    with pytest.raises(KVStreamsError, match="at least 2"):
        make_policy("recent", budget=1)
    with pytest.raises(KVStreamsError, match="too small"):
        make_policy("streaming_llm", budget=4).check_budget(4)  # a round keeps 3 < 4 sinks
    make_policy("streaming_llm", budget=5).check_budget(5)


def test_parse_budget():
    assert parse_budget("0.5") == 0.5 and parse_budget("50%") == 0.5 and parse_budget("256") == 256
    with pytest.raises(KVStreamsError, match="bad budget"):
        parse_budget("half")


def test_recent_and_streaming_choices():
    idx = [5, 0, 9, 1, 7, 2, 8, 3, -1, 6]  # slots in arbitrary order, one empty
    assert kept(make_policy("recent"), view(idx, q=9), 4) == [6, 7, 8, 9]
    assert kept(make_policy("streaming_llm", n_sink=2), view(idx, q=9), 4) == [0, 1, 8, 9]


def test_h2o_keeps_heavy_hitters_and_recent():
    idx = list(range(10))
    cumulative = [0.1, 5.0, 0.2, 0.3, 4.0, 0.1, 0.0, 0.0, 0.0, 0.0]
    policy = make_policy("h2o", budget=7, recent_ratio=0.5)  # target 6: 3 recent + 3 heaviest
    assert kept(policy, view(idx, q=9, budget=7, cumulative=cumulative), 6) == [1, 3, 4, 7, 8, 9]


def test_snapkv_pools_in_sequence_order_and_keeps_window():
    # attention from the window, by trace index: entry 0 is the single heaviest, but 3 and 4 form a
    # cluster; pooling (kernel 3) along the sequence favours the cluster. Slots are scrambled.
    attn_by_index = [0.5, 0.0, 0.0, 0.4, 0.4, 0.0, 0.0, 0.0]
    idx = [3, 0, 1, 2, 4, 5, 6, 7]
    window_attn = [attn_by_index[i] for i in idx]
    policy = make_policy("snapkv", window=2, kernel_size=3, interval=1)
    assert kept(policy, view(idx, q=7, window=window_attn), 4) == [3, 4, 6, 7]
    no_pool = make_policy("snapkv", window=2, kernel_size=1, interval=1)
    assert kept(no_pool, view(idx, q=7, window=window_attn), 4)[0] == 0


def test_knorm_keeps_low_norm_keys():
    keys = torch.zeros(1, 1, 5, 4)
    for i, norm in enumerate([3.0, 0.1, 2.0, 0.2, 1.0]):
        keys[0, 0, i, 0] = norm
    assert kept(make_policy("knorm"), view([0, 1, 2, 3, 4], q=4, keys=keys), 2) == [1, 3]


def test_random_is_seeded():
    idx = list(range(20))
    a = kept(make_policy("random"), view(idx, q=19), 8)
    b = kept(make_policy("random"), view(idx, q=19), 8)
    assert a == b and len(a) == 8


def test_non_evicting_rows_keep_everything():
    v = view([0, 1, 2, 3, -1], q=3)
    keep = choose_kept(make_policy("recent"), v, torch.tensor([1]), torch.tensor([False]))
    assert keep[0, 0].tolist() == [True, True, True, True, False]


def test_user_policy_in_one_class():
    @register("oldest_test")
    @dataclass
    class Oldest(EvictionPolicy):
        def score(self, v: EntryView) -> torch.Tensor:
            return -v.index.float()

    try:
        assert kept(make_policy("oldest_test"), view(list(range(6)), q=5), 3) == [0, 1, 2]
    finally:
        POLICIES.pop("oldest_test")

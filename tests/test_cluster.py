"""Scale-out (kvstreams.cluster): the same rollouts and the same learner step whatever the layout.

The first tests need no Ray (sharding, the wire format, merged costs, mid-rollout weights); the
others start one local Ray for the module: 2 rollout workers and 2 FSDP2 ranks (gloo) against the
single-process path, a worker killed with SIGKILL, and a run resumed under another layout.
"""

from __future__ import annotations

import copy
import json
import os
import signal

import pytest
import torch

from kvstreams.cluster.wire import (
    batch_from_wire,
    batch_to_wire,
    merge_batches,
    state_from_bytes,
    state_to_bytes,
)
from kvstreams.cluster.workers import RolloutWorker, shard_plan
from kvstreams.errors import KVStreamsError, TraceFormatError
from kvstreams.models import load_model
from kvstreams.train.config import validate_config
from kvstreams.train.learner import Learner, micro_batches
from kvstreams.train.prepare import learner_items
from kvstreams.train.rollouts import EpisodePlan, RolloutSource, training_plan


def _cfg(model_dir: str, out: str = "runs/unused", **cluster) -> dict:
    return {
        "model": {"path": model_dir},
        "rollout": {
            "env": "memory",
            "env_args": {"n_turns": 3, "n_facts": 1, "noise_words": 8},
            "strategy": "markovian",
            "strategy_args": {"token_budget": 160},
            "prompts_per_step": 3,
            "group_size": 2,
            "max_reply_tokens": 12,
        },
        "loss": {"entropy_coef": 0.01},
        "optim": {"micro_batch_tokens": 400},
        "train": {"steps": 2, "eval_every": 0, "out_dir": out, "tensorboard": False, "plots": False},
        "cluster": cluster,
    }


def _same_rollouts(a, b) -> None:
    """Same episodes: tokens, death records, rewards, groups; sampler log-probs to float rounding."""
    assert a.rewards == b.rewards and a.errors == b.errors
    assert [(s.group, s.episode) for s in a.samples] == [(s.group, s.episode) for s in b.samples]
    for x, y in zip(a.samples, b.samples, strict=True):
        assert torch.equal(x.trace.tokens, y.trace.tokens) and torch.equal(x.trace.death, y.trace.death)
        torch.testing.assert_close(
            x.trace.sampler_logprobs, y.trace.sampler_logprobs, atol=1e-4, rtol=0, equal_nan=True
        )
    for key in ("episodes", "tokens_forwarded", "tokens_trace", "compactions", "kv_peak_entries"):
        assert getattr(a.stats, key) == getattr(b.stats, key), key
    assert a.stats.tokens_reprefilled_predicted == pytest.approx(b.stats.tokens_reprefilled_predicted)


# --- without Ray -------------------------------------------------------------------------------------
def test_shards_are_contiguous_whole_groups_covering_the_plan():
    plan = EpisodePlan(list(range(10)), list(range(100, 110)), [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    for n in (1, 2, 3, 4, 5, 7):
        shards = shard_plan(plan, n)
        assert len(shards) == min(n, 5)
        assert [x for _, s in shards for x in s.env_seeds] == plan.env_seeds
        assert [x for _, s in shards for x in s.sample_seeds] == plan.sample_seeds
        groups = [set(s.groups) for _, s in shards]
        assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :])  # no group split
        sizes = [len(s) for _, s in shards]
        assert max(sizes) - min(sizes) <= 2  # as even as whole groups of 2 allow


def test_shards_merged_are_the_single_process_batch(model_dirs):
    cfg = validate_config(_cfg(model_dirs["qwen3"]))
    model, tokenizer = load_model(cfg.model.path)
    source = RolloutSource(model, tokenizer, cfg)
    plan = training_plan(cfg, step=1)
    whole = source.run(plan)
    assert whole.stats.compactions > 0  # the costs below merge compaction means
    parts = [source.run(shard) for _, shard in shard_plan(plan, 2)]
    merged = merge_batches(parts)
    _same_rollouts(whole, merged)
    assert merged.outcomes == whole.outcomes and len(whole.outcomes) == len(plan)


def test_batches_cross_processes_as_safetensors_and_are_checked(model_dirs):
    cfg = validate_config(_cfg(model_dirs["qwen3"]))
    model, tokenizer = load_model(cfg.model.path)
    batch = RolloutSource(model, tokenizer, cfg).run(training_plan(cfg, 0).shard(0, 2))
    wire = batch_to_wire(batch)
    assert all(isinstance(t, bytes) for t in wire["traces"])
    json.dumps({k: v for k, v in wire.items() if k != "traces"})  # the rest is plain data
    back = batch_from_wire(wire)
    _same_rollouts(batch, back)
    assert all(
        torch.equal(a.trace.sampler_logprobs.nan_to_num(), b.trace.sampler_logprobs.nan_to_num())
        for a, b in zip(batch.samples, back.samples, strict=True)
    )
    with pytest.raises(KVStreamsError, match="not a rollout batch"):
        batch_from_wire({**wire, "extra": 1})
    with pytest.raises(KVStreamsError, match="safetensors bytes"):
        batch_from_wire({**wire, "traces": [object()] * len(wire["traces"])})
    with pytest.raises(TraceFormatError, match="trace 0"):
        batch_from_wire({**wire, "traces": [b"\x08" + wire["traces"][0][1:], *wire["traces"][1:]]})
    with pytest.raises(KVStreamsError, match="cost"):
        batch_from_wire({**wire, "cost": {**wire["cost"], "tokens_forwarded": "many"}})
    assert back.outcomes == batch.outcomes and batch.outcomes[0]["correct"] in (0.0, 1.0)
    with pytest.raises(KVStreamsError, match="outcomes"):
        batch_from_wire({**wire, "outcomes": [{"correct": "yes"}] * len(wire["outcomes"])})


def test_a_worker_takes_new_weights_between_decode_steps(model_dirs):
    """A worker handed newer weights mid-shard loads them through the running session's
    ``update_weights`` (its KV cache kept), and the tokens sampled after record the version."""
    cfg = validate_config(_cfg(model_dirs["qwen3"]))
    worker = RolloutWorker(cfg.model_dump(), threads=1)
    newer = {k: v + 0.01 for k, v in worker.source.model.state_dict().items()}
    state = state_to_bytes(newer)
    assert all(torch.equal(newer[k], v) for k, v in state_from_bytes(state).items())
    handed = []

    def on_step(n, target):
        if n == 3:
            worker.set_weights(state, version=7)
        calls = len(handed)
        worker._take(n, _Recorder(target, handed))
        assert len(handed) == calls + (n == 3)

    plan = training_plan(cfg, 0).shard(0, 2)
    batch = worker.source.run(plan, on_step=on_step)
    assert handed == [7]
    versions = torch.cat([s.trace.weights_version[s.trace.sampled_mask] for s in batch.samples])
    assert set(versions.tolist()) == {0, 7}
    assert torch.equal(worker.source.model.model.embed_tokens.weight, newer["model.embed_tokens.weight"])


class _Recorder:
    def __init__(self, target, handed) -> None:
        self.target, self.handed = target, handed

    def update_weights(self, state, version) -> None:
        self.handed.append(version)
        self.target.update_weights(state, version)


def test_cluster_config_is_checked_before_any_process_starts(monkeypatch):
    assert not validate_config({}).cluster.distributed
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    validate_config({})  # the single-process path never needs Ray
    with pytest.raises(KVStreamsError, match=r"needs Ray: pip install 'kvstreams\[cluster\]'"):
        validate_config({"cluster": {"rollout_workers": 2}})
    monkeypatch.undo()
    with pytest.raises(KVStreamsError, match=r"cluster\.learner_gpus"):
        validate_config({"model": {"device": "cuda"}, "cluster": {"learner_world_size": 2}})
    with pytest.raises(KVStreamsError, match=r"cluster\.rollout_workers"):
        validate_config({"cluster": {"rollout_workers": -1}})
    with pytest.raises(KVStreamsError, match=r"cluster\.workers"):
        validate_config({"cluster": {"workers": 2}})


# --- with Ray ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_two_workers_give_the_single_process_rollouts_and_survive_a_kill(ray_local, model_dirs):
    from kvstreams.cluster.workers import WorkerPool

    cfg = validate_config(_cfg(model_dirs["qwen3"], rollout_workers=2, max_worker_restarts=1))
    model, tokenizer = load_model(cfg.model.path)
    local = RolloutSource(model, tokenizer, cfg).collect(1)
    pool = WorkerPool(cfg)
    try:
        pool.publish(model.state_dict(), 1)
        batch = pool.collect(1)
        _same_rollouts(local, batch)
        assert {int(v) for s in batch.samples for v in s.trace.weights_version[s.trace.sampled_mask]} == {1}
        # kill -9 one worker: it is started again and its shard rerun, the same batch comes back
        os.kill(pool.pids()[1], signal.SIGKILL)
        _same_rollouts(local, pool.collect(1))
        assert pool.metrics() == {"cluster/worker_restarts": 1.0, "cluster/episodes_dropped": 0.0}
        # restarts spent: the next death drops the shard's episodes, counted, as failed episodes
        os.kill(pool.pids()[0], signal.SIGKILL)
        dropped = pool.collect(1)
        first = len(shard_plan(training_plan(cfg, 1), 2)[0][1])
        assert pool.metrics()["cluster/episodes_dropped"] == first
        assert all("rollout worker 0 died" in e for e in dropped.errors[:first])
        assert dropped.errors[first:] == local.errors[first:]
        assert {s.episode for s in dropped.samples} == set(range(first, len(local.rewards)))
    finally:
        pool.close()


def test_two_fsdp2_ranks_take_the_single_process_step(ray_local, model_dirs):
    """Step-1 loss, gradient norm, weights after the update and optimizer state: 2 gloo ranks agree
    with one process (with rewards that differ, KL to a reference, 2 updates, 3 micro-batches)."""
    from kvstreams.cluster.fsdp import LearnerGroup

    raw = _cfg(model_dirs["qwen3"], learner_world_size=2)
    raw["loss"] = {"type": "tis", "kl_coef": 0.05, "entropy_coef": 0.01}
    raw["optim"] = {"micro_batch_tokens": 600, "updates_per_batch": 2}
    cfg = validate_config(raw)
    model, tokenizer = load_model(cfg.model.path)
    batch = RolloutSource(model, tokenizer, cfg).collect(0)
    for s in batch.samples:
        s.reward = float(s.episode % 3)
    batch.rewards = [float(i % 3) for i in range(len(batch.rewards))]
    items, _ = learner_items(batch, 0, cfg.rollout.group_size, True, 3)
    single = Learner(copy.deepcopy(model), cfg, load_model(cfg.model.path)[0])
    expected = single.step(items)
    group = LearnerGroup(cfg, Learner(model, cfg), resumed=False)
    try:
        got = group.step(items)
        group.gather(optimizer=True)
    finally:
        group.close()
    assert len({len(i.trace) for i in items}) > 1 and expected["loss/pg"] != 0
    # an odd number of micro-batches: rank 1 runs a stand-in to keep FSDP2's collectives in step
    assert len(micro_batches(items, cfg.optim.micro_batch_tokens)) % 2 == 1
    for key in ("loss/pg", "loss/kl", "entropy/mean", "grad/norm", "tokens/trained", "mismatch/k3_kl"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(single.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    s, g = single.optimizer.state_dict()["state"], group.optimizer.state_dict()["state"]
    assert s.keys() == g.keys()
    for i in s:
        torch.testing.assert_close(s[i]["exp_avg_sq"], g[i]["exp_avg_sq"], atol=1e-9, rtol=1e-3)
    assert group.scheduler.state_dict()["last_epoch"] == single.scheduler.state_dict()["last_epoch"] == 2


def _train(raw: dict, resume: bool = False) -> list[dict]:
    from kvstreams.loop import train

    train(validate_config(raw), resume=resume, show_progress=False)
    with open(f"{raw['train']['out_dir']}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_a_run_on_two_workers_and_two_ranks_is_the_single_process_run(ray_local, model_dirs, tmp_path):
    """`kvstreams train` with [cluster] 2 x 2: the same rollouts (tokens, rewards, costs), step-1 loss
    and gradient norm as without [cluster]; its checkpoint resumes under another layout (no workers, 2
    ranks) to the step the single-process run reaches."""
    single = _cfg(model_dirs["qwen3"], str(tmp_path / "single"))
    cluster = _cfg(model_dirs["qwen3"], str(tmp_path / "cluster"), rollout_workers=2, learner_world_size=2)
    for raw in (single, cluster):
        raw["train"]["steps"] = 1
    a, b = _train(single)[-1], _train(cluster)[-1]
    for key in ("tokens/forwarded", "tokens/trace", "rollout/compactions", "reward/mean", "tokens/trained"):
        assert a[key] == b[key], key
    for key in ("loss/pg", "entropy/mean", "grad/norm", "mismatch/k3_kl"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
    assert b["cluster/worker_restarts"] == 0 and a["grad/norm"] > 0
    # the 2 x 2 checkpoint is the single-process format: resume it with rollouts in the trainer's
    # process and 2 ranks (which load the gathered optimizer state) to the single-process run's step 2
    for raw in (single, cluster):
        raw["train"]["steps"] = 2
    cluster["cluster"] = {"rollout_workers": 0, "learner_world_size": 2}
    a, b = _train(single, resume=True)[-1], _train(cluster, resume=True)[-1]
    assert a["step"] == b["step"] == 2
    for key in ("tokens/forwarded", "reward/mean"):
        assert a[key] == b[key], key
    for key in ("loss/pg", "grad/norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key
    # the weights after step 2: equal only if the ranks continued AdamW's moments and the schedule
    from safetensors.torch import load_file

    ends = [
        load_file(f"{r['train']['out_dir']}/checkpoints/step-000001/model.safetensors")
        for r in (single, cluster)
    ]
    for name, value in ends[0].items():
        torch.testing.assert_close(ends[1][name], value, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_asynchronous_training_on_workers_keeps_the_async_bound(ray_local, model_dirs, tmp_path):
    """Asynchronous `kvstreams train` on 2 rollout workers: the rollouts of step s start with weights
    of version >= s - max_async_level, none newer than s, and new versions reach the workers."""
    raw = _cfg(model_dirs["qwen3"], str(tmp_path / "async"), rollout_workers=2)
    raw["train"].update(steps=4, asynchronous=True, max_async_level=1, max_off_policy_steps=1)
    raw["train"].update(eval_every=2, eval_episodes=2)  # evaluation must not disturb the workers' versions
    rows = [r for r in _train(raw) if "rollout/version_min" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        step = r["step"] - 1
        assert step - 1 <= r["rollout/version_min"] <= r["rollout/version_max"] <= step
        assert r["off_policy/token_staleness_max"] <= 1 and r["off_policy/dropped_frac"] == 0
    assert max(r["rollout/version_max"] for r in rows) >= 2

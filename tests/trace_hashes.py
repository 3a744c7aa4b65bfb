"""Trace fingerprints of every sampler setting that existed before recall and the one-sampler work:
each compaction strategy in stream and re-prefill mode, full mode, compression inside episodes (an
entry count and a share), every single-turn policy (tiny qwen3, fixed seeds), and the single-turn
batch's other paths (added before the one-session refactor): per-sequence share budgets, ``budget_of =
"context"``, a seeded random policy, rows that stop at different lengths and leave the batch, and
weights updated by ``on_step`` in the middle of a generation (these also hash the batch's
``GenerationStats``). A refactor of the samplers must leave them bit-for-bit unchanged:
``tests/test_trace_hashes.py`` compares them with ``tests/data/trace_hashes.json``.

Floating point makes the fingerprints specific to the torch version and the CPU (capability, vendor,
family and model) they were recorded on: the file holds one record per environment, and where none
matches the test skips and says so. The first record (2026-12) predates the CPU model's being noted
(`cpu_model` "unrecorded"). Re-record (after a change that is *meant* to alter
traces, said in the commit) with

    python tests/trace_hashes.py MODEL_DIR --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "data" / "trace_hashes.json"
_TENSORS = (
    "tokens",
    "positions",
    "death",
    "sampled_mask",
    "loss_mask",
    "sampler_logprobs",
    "weights_version",
)


def _cpu_model() -> str:
    """The CPU's vendor, family and model numbers (/proc/cpuinfo): two CPUs with the same capability
    (AVX512) round differently (seen 2026-12-08: every fingerprint changed on another machine)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    info = dict(line.split(":", 1) for line in lines if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    return f"{info.get('vendor_id', '?')} family {info.get('cpu family', '?')} model {info.get('model', '?')}"


def environment() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": _cpu_model(),
    }


def golden_for(here: dict[str, str]) -> dict | None:
    """The recorded fingerprints of this environment, if any were recorded on it."""
    records = json.loads(GOLDEN.read_text())["records"]
    return next((r for r in records if all(r.get(k) == v for k, v in here.items())), None)


def fingerprint(traces, extra: str = "") -> str:
    """sha256 over every tensor and every metadata value but the model's path (and ``extra``)."""
    d = hashlib.sha256()
    for t in traces:
        for name in _TENSORS:
            x = getattr(t, name)
            d.update(name.encode())
            d.update(x.contiguous().view(torch.uint8).numpy().tobytes() if x is not None else b"-")
        d.update(repr(sorted((k, v) for k, v in t.metadata.items() if k != "model")).encode())
    d.update(extra.encode())
    return d.hexdigest()[:16]


def fingerprints(model, tokenizer) -> dict[str, str]:
    return {**_episode_fingerprints(model, tokenizer), **_single_turn_fingerprints(model, tokenizer)}


def _episode_fingerprints(model, tokenizer) -> dict[str, str]:
    from kvstreams.compaction import STRATEGIES, make_strategy
    from kvstreams.engine import SamplingParams
    from kvstreams.envs import make_env
    from kvstreams.episodes import EpisodeRunner
    from kvstreams.policies import make_policy

    def episodes(strategy, mode, policy=None):
        runner = EpisodeRunner(
            model, tokenizer, strategy, mode=mode, sampling=SamplingParams(seed=0), policy=policy
        )
        results, _ = runner.run([make_env("memory") for _ in range(2)], [1, 2])
        return fingerprint([t for r in results for t in r.traces])

    out = {}
    for name in sorted(STRATEGIES):
        for mode in ("stream", "reprefill"):
            out[f"{name}/{mode}"] = episodes(make_strategy(name), mode)
    out["full"] = episodes(None, "full")
    out["markovian+snapkv"] = episodes(
        make_strategy("markovian"), "stream", make_policy("snapkv", budget=48, interval=4)
    )
    out["full+h2o@0.5"] = episodes(None, "full", make_policy("h2o", budget=0.5, interval=4))
    out["sliding_window+random@0.6"] = episodes(
        make_strategy("sliding_window"), "stream", make_policy("random", budget=0.6, interval=4)
    )
    return out


def _single_turn_fingerprints(model, tokenizer) -> dict[str, str]:
    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.policies import POLICIES, make_policy

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (40, 70, 25)]
    params = SamplingParams(max_new_tokens=60, seed=1, stop_token_ids=())
    out = {}
    for name in sorted(POLICIES):
        policy = make_policy(name, budget=48, interval=4) if name != "full" else make_policy("full")
        out[f"policy/{name}"] = fingerprint(RolloutEngine(model, tokenizer, policy).generate(prompts, params))

    def run(policy, params, prompts=prompts, on_step=None):
        engine = RolloutEngine(model, tokenizer, policy)
        traces = engine.generate(prompts, params, on_step=on_step)
        return fingerprint(traces, repr(engine.last_stats))

    shares = {
        "snapkv@0.5": make_policy("snapkv", budget=0.5, interval=4),
        "h2o@0.6": make_policy("h2o", budget=0.6, interval=4),
        "streaming_llm@0.3": make_policy("streaming_llm", budget=0.3, interval=2),
        "knorm@0.5/context": make_policy("knorm", budget=0.5, interval=4, budget_of="context"),
        "snapkv@0.6/context": make_policy("snapkv", budget=0.6, interval=4, window=8, budget_of="context"),
        "random@0.5": make_policy("random", budget=0.5, interval=4),
    }
    for label, policy in shares.items():
        out[f"policy/{label}"] = run(policy, params)
    out["policy/random@48/seed5"] = run(make_policy("random", budget=48, interval=4), replace(params, seed=5))
    out["policy/random@0.5/seed5"] = run(shares["random@0.5"], replace(params, seed=5))
    # rows sample a stop token at different steps (or run to max_new_tokens) and leave the batch
    stopping = [*prompts, torch.randint(5, 500, (55,), generator=g).tolist()]
    stops = SamplingParams(max_new_tokens=40, seed=3, stop_token_ids=tuple(range(5, 25)))
    for label in ("full", "h2o@48", "snapkv@0.5", "knorm@0.5/context", "random@0.5"):
        policy = make_policy("h2o", budget=48, interval=4) if label == "h2o@48" else shares.get(label)
        out[f"stop/{label}"] = run(policy or make_policy("full"), stops, stopping)

    def new_weights(step, engine):  # the same weights, a new version from the 11th token on
        if step == 10:
            engine.update_weights(model.state_dict(), 7)

    for label in ("full", "snapkv@0.5"):
        out[f"on_step/{label}"] = run(shares.get(label) or make_policy("full"), params, on_step=new_weights)
    out["on_step+stop/h2o@0.6"] = run(shares["h2o@0.6"], stops, stopping, new_weights)
    return out


if __name__ == "__main__":
    from kvstreams.models import load_model

    torch.set_num_threads(1)
    found = fingerprints(*load_model(sys.argv[1]))
    print(json.dumps(found, indent=1))
    if "--write" in sys.argv:  # this environment's record replaced, the others kept
        here = environment()
        records = json.loads(GOLDEN.read_text())["records"]
        records = [r for r in records if any(r.get(k) != v for k, v in here.items())]
        GOLDEN.write_text(json.dumps({"records": [*records, {**here, "hashes": found}]}, indent=1) + "\n")

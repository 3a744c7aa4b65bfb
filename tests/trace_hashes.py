"""Trace fingerprints of every sampler setting that existed before recall and the one-sampler work:
each compaction strategy in stream and re-prefill mode, full mode, Markovian with SnapKV inside, and
every single-turn policy (tiny qwen3, fixed seeds). A refactor of the samplers must leave them
bit-for-bit unchanged: ``tests/test_trace_hashes.py`` compares them with ``tests/data/trace_hashes.json``.

Floating point makes the fingerprints specific to the torch version and CPU capability they were
recorded on; elsewhere the test skips and says so. Re-record (after a change that is *meant* to alter
traces, said in the commit) with

    python tests/trace_hashes.py MODEL_DIR --write
"""

from __future__ import annotations

import hashlib
import json
import sys
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


def environment() -> dict[str, str]:
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}


def fingerprint(traces) -> str:
    """sha256 over every tensor and every metadata value but the model's path."""
    d = hashlib.sha256()
    for t in traces:
        for name in _TENSORS:
            x = getattr(t, name)
            d.update(name.encode())
            d.update(x.contiguous().view(torch.uint8).numpy().tobytes() if x is not None else b"-")
        d.update(repr(sorted((k, v) for k, v in t.metadata.items() if k != "model")).encode())
    return d.hexdigest()[:16]


def fingerprints(model, tokenizer) -> dict[str, str]:
    from kvstreams.compaction import STRATEGIES, make_strategy
    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.envs import make_env
    from kvstreams.episodes import EpisodeRunner
    from kvstreams.policies import POLICIES, make_policy

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
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (40, 70, 25)]
    params = SamplingParams(max_new_tokens=60, seed=1, stop_token_ids=())
    for name in sorted(POLICIES):
        policy = make_policy(name, budget=48, interval=4) if name != "full" else make_policy("full")
        out[f"policy/{name}"] = fingerprint(RolloutEngine(model, tokenizer, policy).generate(prompts, params))
    return out


if __name__ == "__main__":
    from kvstreams.models import load_model

    torch.set_num_threads(1)
    found = fingerprints(*load_model(sys.argv[1]))
    print(json.dumps(found, indent=1))
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps({**environment(), "hashes": found}, indent=1) + "\n")

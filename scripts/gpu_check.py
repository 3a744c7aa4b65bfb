"""One-shot GPU check (``make gpu-check``): the real model in bfloat16 on CUDA, in at most 8 minutes.

1. verify: snapkv, recent and streaming_llm at 50% of each sequence, bf16 on CUDA: the shadow
   learner against the sampler (bf16 tolerance 0.1) and the dense learner's gap;
2. GRPO: a few steps on the recall task with SnapKV compression, the shadow correction with SMD's
   distillation track, the flex_attention backend (its backward exists on CUDA), bf16;
3. replay memory: flex_attention forward and forward+backward against plain causal attention and
   the dense-mask SDPA path, at T = 4,096 and 16,384 (CUDA allocated memory).

Writes ``OUT/gpu-check.json`` and prints what it measured. ``--device cpu --model DIR`` runs the same
steps on a CPU (flex's backward then reported as not run) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (converted by make real-model) or a directory"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default="runs/gpu-check")
    parser.add_argument("--lengths", default="4096,16384", help="replay lengths for the memory check")
    args = parser.parse_args(argv)

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; run it on a GPU machine (or --device cpu to check the script)")
        return 2
    from kvstreams.bench.models import bench_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = bench_model(args.model, out / "models")
    report: dict = {
        "model": str(path),
        "device": args.device,
        "dtype": args.dtype,
        "torch": torch.__version__,
    }
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
    started = time.perf_counter()
    report["verify"] = verify(path, args)
    report["grpo"] = grpo(path, args, out)
    report["replay_memory"] = replay_memory(path, args, [int(x) for x in args.lengths.split(",")])
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


def verify(path: Path, args) -> list[dict]:
    from kvstreams.engine import SamplingParams
    from kvstreams.models import load_model
    from kvstreams.policies import make_policy
    from kvstreams.prompts import synthetic_prompts
    from kvstreams.verify import verify_policy

    model, tok = load_model(path, dtype=args.dtype, device=args.device)
    prompts = synthetic_prompts(tok, 4, 256, seed=0)
    params = SamplingParams(max_new_tokens=256, stop_token_ids=(), seed=0)
    rows = []
    for name in ("snapkv", "recent", "streaming_llm"):
        report, _ = verify_policy(model, tok, make_policy(name, budget=0.5), prompts, params)
        rows.append(
            {
                "policy": name,
                "kv_saving": report.kv_saving,
                "shadow_max_abs": report.shadow.max_abs_diff,
                "shadow_mean_abs": report.shadow.mean_abs_diff,
                "dense_max_abs": report.dense.max_abs_diff,
                "dense_kl_k3": report.dense.kl_k3,
                "passed": report.passed,
            }
        )
        print(f"verify {name}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def grpo(path: Path, args, out: Path) -> dict:
    from kvstreams.loop import train
    from kvstreams.train.config import load_config

    backend = "flex" if args.device.startswith("cuda") else "sdpa"
    cfg = load_config(
        None,
        [
            f'model.path="{path}"',
            f'model.dtype="{args.dtype}"',
            f'model.device="{args.device}"',
            'rollout.env="recall"',
            'rollout.policy="snapkv"',
            "rollout.policy_args={budget = 0.5}",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=16",
            "loss.distill_coef=0.1",
            "optim.lr=1e-6",
            "train.steps=3",
            "train.eval_every=0",
            f'train.backend="{backend}"',
            f'train.out_dir="{out / "train"}"',
        ],
    )
    started = time.perf_counter()
    summary = train(cfg, show_progress=False)
    final = summary["final"]
    keys = (
        "reward/mean",
        "mismatch/k3_kl",
        "mismatch/abs_logprob_diff_max",
        "loss/pg",
        "loss/distill",
        "kv/saving",
    )
    return {"backend": backend, "seconds": round(time.perf_counter() - started, 1)} | {
        k: final.get(k) for k in keys
    }


def replay_memory(path: Path, args, lengths: list[int]) -> list[dict]:
    import torch

    from kvstreams.bench.learner import _replay_row, synthetic_trace
    from kvstreams.models import load_model, model_shape

    model, _ = load_model(path, dtype=args.dtype, device=args.device)
    shape = model_shape(model)
    causal_peak: dict = {}
    rows = []
    for length in lengths:
        trace = synthetic_trace(length, shape.n_layers, shape.n_kv_heads, shape.vocab_size)
        # the dense mask is T x T per layer and head: kept to the shorter lengths
        for backend in ("causal", "flex", "sdpa") if length <= 4096 else ("causal", "flex"):
            for backward in (False, True):
                try:
                    row = _replay_row(model, shape, trace, backend, backward, causal_peak)
                except torch.OutOfMemoryError:
                    row = {"T": length, "backend": backend, "backward": backward, "note": "out of memory"}
                    torch.cuda.empty_cache()
                rows.append(row)
                print(f"replay {row}", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

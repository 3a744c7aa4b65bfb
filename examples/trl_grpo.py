"""TRL's GRPOTrainer with kvstreams sampling under KV compression, and the learner replaying it.

    python examples/trl_grpo.py --max-steps 2          # about a minute on 2 CPU cores

The model is SmolLM2-135M-Instruct with a LoRA adapter when `make real-model` has converted it, else a
tiny random model made on the spot. Each step, kvstreams samples the environment's episodes with
SnapKV keeping 50% of the KV cache; TRL scores, groups and trains them. For every step it prints the
reward and the sampler/learner mismatch on the trained tokens two ways: the learner replaying the
sampler's eviction record (what this trainer trains with) and stock TRL's dense forward on the same
rollouts (the gap TRL would train with). Requires `pip install -e '.[trl]'`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in trl 1.16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local HF model directory (default: SmolLM2 if converted, else tiny)")
    p.add_argument("--env", default="recall", help="a kvstreams environment (default: recall)")
    p.add_argument("--policy", default="snapkv", help="KV compression while sampling (default: snapkv)")
    p.add_argument("--budget", type=float, default=0.5, help="share of the KV cache kept (default: 0.5)")
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4, help="GRPO group size")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step")
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora", choices=("auto", "on", "off"), default="auto", help="auto: on for SmolLM2")
    p.add_argument(
        "--replay", choices=("shadow", "dense"), default="shadow", help="dense: train as stock TRL"
    )
    p.add_argument("--distill-coef", type=float, default=0.0, help="SMD's distillation term (0: off)")
    p.add_argument("--out", default="runs/trl-grpo")
    return p.parse_args()


def pick_model(args: argparse.Namespace) -> tuple[Path, bool]:
    """(model directory, is it the real model)."""
    from kvstreams.pretrained import default_dir

    if args.model:
        return Path(args.model), False
    real = default_dir("smollm2")
    if (real / "config.json").is_file():
        return real, True
    from kvstreams.tiny import make_tiny_model

    tiny = Path(args.out) / "models" / "tiny-qwen3"
    if not (tiny / "config.json").is_file():
        make_tiny_model(tiny, arch="qwen3")
    return tiny, False


def main() -> int:
    args = parse_args()
    from peft import LoraConfig
    from trl import GRPOConfig

    from kvstreams.integrations.trl import KVStreamsGRPOTrainer, KVStreamsRollout
    from kvstreams.models import load_model

    path, real = pick_model(args)
    lora = args.lora == "on" or (args.lora == "auto" and real)
    print(f"model {path}{' + LoRA' if lora else ''}; env {args.env}; {args.policy} keeping {args.budget:.0%}")
    model, tokenizer = load_model(path)

    # kvstreams samples (and records what each KV head stopped seeing); TRL owns the rest of the step.
    rollout = KVStreamsRollout(env=args.env, policy=args.policy, policy_args={"budget": args.budget})
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trainer"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.lr,
        bf16=False,  # CPU: float32 end to end
        gradient_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = KVStreamsGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=rollout.reward,
        rollout_func=rollout,
        train_dataset=rollout.dataset(range(256)),
        args=config,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        if lora
        else None,
        replay=args.replay,
        distill_coef=args.distill_coef,
        log_dense_gap=True,  # one more no-grad forward a step: stock TRL's view of the same rollouts
    )
    trainer.train()
    return report(trainer.state.log_history, args.replay)


def report(history: list[dict], replay: str) -> int:
    """One line per step, then the verdict: replay at float level, dense far from it."""
    steps = [h for h in history if "mismatch/abs_logprob_diff_max" in h]
    trained = "replayed record" if replay == "shadow" else "dense (stock TRL)"
    print(f"\n{'step':>4}  {'reward':>7}  {'trained with: ' + trained:>34}  {'stock TRL, dense':>26}")
    print(f"{'':>4}  {'':>7}  {'max|dlogp|':>16} {'k3 KL':>17}  {'max|dlogp|':>12} {'k3 KL':>13}")
    for i, h in enumerate(steps, 1):
        print(
            f"{i:>4}  {h['reward']:7.3f}  {h['mismatch/abs_logprob_diff_max']:16.2e} {h['mismatch/k3_kl']:17.2e}"
            f"  {h['dense_gap/abs_logprob_diff_max']:12.3f} {h['dense_gap/k3_kl']:13.4f}"
        )
    worst = max(h["mismatch/abs_logprob_diff_max"] for h in steps)
    dense = min(h["dense_gap/abs_logprob_diff_max"] for h in steps)
    print(
        f"\nsampler vs learner, max |d log p| over steps: {worst:.2e} trained; stock TRL's forward: {dense:.3f} or more"
    )
    if replay == "shadow" and worst > 1e-3:
        print("the replay is not at float level: please report this", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``kvstreams sft``: warm-start a model on an environment's expert demonstrations.

Demonstrations are whole episodes played by the environment's expert, rendered token-in/token-out
exactly like rollouts (the expert's replies are the assistant turns, with the loss on them only).
A tiny random model learns the format and the habit the expert shows (for ``memory``: carrying the
facts in every reply), so RL on CPU starts from a policy that earns some reward.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from kvstreams.atomic import ensure_writable
from kvstreams.chat import ChatFormat
from kvstreams.envs import make_env
from kvstreams.errors import KVStreamsError
from kvstreams.models import load_model
from kvstreams.train.config import Config


def demonstrations(
    tokenizer, env_name: str, env_args: dict[str, Any], episodes: int, seed: int
) -> list[tuple[list[int], list[bool]]]:
    """(tokens, loss mask) per expert episode."""
    chat = ChatFormat(tokenizer)
    out = []
    for i in range(episodes):
        env = make_env(env_name, **env_args)
        tokens = chat.head(env.reset(seed + i))
        mask = [False] * len(tokens)
        for _ in range(env.max_turns):
            try:
                reply = env.expert_reply()
            except NotImplementedError:
                raise KVStreamsError(f"environment {env_name!r} has no expert to learn from") from None
            header = chat.assistant_header()
            body = [*chat.encode(reply), chat.end_of_turn]
            tokens += header + body
            mask += [False] * len(header) + [True] * len(body)
            result = env.step(reply)
            if result.done:
                break
            following = chat.after_reply(result.messages)
            tokens += following
            mask += [False] * len(following)
        env.close()
        out.append((tokens, mask))
    return out


def validation_reward(model, tokenizer, cfg: Config) -> float:
    """Mean sampled reward on ``sft.check_episodes`` held-out validation tasks (seeds from
    ``train.eval_seed + 500000``: not the tasks the evaluation reports on, so stopping on them does
    not select the warm start on its test set)."""
    from kvstreams.train.evaluation import evaluate
    from kvstreams.train.rollouts import RolloutSource

    model.eval()
    validation = cfg.model_copy(deep=True)
    validation.train.eval_seed = cfg.train.eval_seed + 500_000
    source = RolloutSource(model, tokenizer, validation)
    return evaluate(source, cfg.sft.check_episodes, samples=1, greedy=False)["eval/reward_mean"]


def check_output(base: Path, out: Path, force: bool) -> None:
    """Refuse, before any compute, an ``sft.out`` that would destroy a model: the base itself (never,
    even with ``force``: training reads it) or any directory already holding one (unless ``force``)."""
    if out.resolve() == base.resolve():
        raise KVStreamsError(f"sft.out is sft.base ({str(base)!r}): the SFT model would replace its base")
    if (out / "config.json").exists() and not force:
        raise KVStreamsError(f"sft.out {str(out)!r} already holds a model; pass --force to overwrite it")


def _batch(chosen: list, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 outside the expert's own tokens) of
    ``(tokens, mask)`` demonstrations."""
    width = max(len(t) for t, _ in chosen)
    ids = torch.full((len(chosen), width), pad, dtype=torch.long)
    labels = torch.full((len(chosen), width), -100, dtype=torch.long)
    attention = torch.zeros((len(chosen), width), dtype=torch.long)
    for b, (tokens, mask) in enumerate(chosen):
        ids[b, : len(tokens)] = torch.tensor(tokens)
        attention[b, : len(tokens)] = 1
        labels[b, : len(tokens)] = torch.where(torch.tensor(mask), torch.tensor(tokens), -100)
    return ids, attention, labels


def sft(cfg: Config, show_progress: bool = True, force: bool = False) -> dict[str, Any]:
    s, r = cfg.sft, cfg.rollout
    check_output(Path(s.base), Path(s.out), force)
    ensure_writable(Path(s.out), "sft.out")
    model, tokenizer = load_model(s.base, dtype="float32", device=cfg.model.device)
    demos = demonstrations(tokenizer, r.env, r.env_args, s.episodes, s.seed)
    rng = random.Random(s.seed)
    torch.manual_seed(s.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 - k / s.steps)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id or 0
    losses = []
    stopped: dict[str, float] | None = None
    model.train()
    for step in range(s.steps):
        chosen = [demos[rng.randrange(len(demos))] for _ in range(s.batch_size)]
        ids, attention, labels = _batch(chosen, pad)
        out = model(
            input_ids=ids.to(device),
            attention_mask=attention.to(device),
            labels=labels.to(device),
            use_cache=False,
        )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if show_progress and (step + 1) % max(1, s.steps // 10) == 0:
            print(
                f"sft step {step + 1}/{s.steps}  loss {sum(losses[-10:]) / len(losses[-10:]):.4f}", flush=True
            )
        if s.stop_at_reward is not None and (step + 1) % s.check_every == 0:
            reward = validation_reward(model, tokenizer, cfg)
            model.train()
            if show_progress:
                print(f"sft step {step + 1}: validation reward {reward:.3f}", flush=True)
            if reward >= s.stop_at_reward:
                stopped = {"step": step + 1, "validation_reward": reward}
                break
    model.eval()
    path = Path(s.out)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    summary = {
        "base": s.base,
        "out": str(path),
        "demonstrations": len(demos),
        "steps": len(losses),
        "stopped_at_reward": stopped,
        "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]),
    }
    (path / "sft.json").write_text(json.dumps(summary, indent=2))
    return summary

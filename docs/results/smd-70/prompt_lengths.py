"""Prompt lengths of smd-70's task in tokens, as the sampler encodes them (the opening messages plus
the assistant header), and the expert reply's length (docs/results.md 1e and 1f):

    python docs/results/smd-70/prompt_lengths.py OUT/models/seed-5/sft

Any of the experiment's warm starts will do: they share the tokenizer. Tasks 10000-10299."""

import sys

from kvstreams.chat import ChatFormat
from kvstreams.envs.recall import RecallEnv
from kvstreams.models import load_model

if __name__ == "__main__":
    _, tokenizer = load_model(sys.argv[1])
    chat = ChatFormat(tokenizer)
    env = RecallEnv(n_filler=1, n_codes=6)
    lengths = []
    for seed in range(10_000, 10_300):
        messages = env.reset(seed)
        lengths.append(len(chat.head(messages)) + len(chat.assistant_header()))
    lengths.sort()
    print(
        f"prompts: min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]} ({len(lengths)} tasks)"
    )
    print(f"expert reply: {len(chat.encode(env.expert_reply()))} tokens (last task)")

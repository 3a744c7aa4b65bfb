"""Environments: experts win, bad replies never crash, rewards in [0, 1]; the chat continuation rule."""

from __future__ import annotations

import pytest

from kvstreams.chat import ChatFormat
from kvstreams.envs import ENVIRONMENTS, make_env, parse_action
from kvstreams.envs.gsm8k import extract_answer
from kvstreams.errors import KVStreamsError


def play(env, seed: int, reply_fn) -> tuple[float, int, dict]:
    env.reset(seed)
    total, turns = 0.0, 0
    while True:
        result = env.step(reply_fn(env))
        total += result.reward
        turns += 1
        if result.done or turns >= env.max_turns:
            return total, turns, result.info


def test_registry_and_errors():
    assert {"memory", "textworld", "gsm8k"} <= set(ENVIRONMENTS)
    with pytest.raises(KVStreamsError, match="unknown environment"):
        make_env("chess")
    with pytest.raises(KVStreamsError, match="no option"):
        make_env("memory", colour=3)


def test_parse_action():
    assert parse_action("<state>x</state><action> go north </action>") == "go north"
    assert parse_action("<action>a</action> then <action>b</action>") == "b"
    assert parse_action("no action here") is None


def test_memory_expert_wins_and_forgetful_agent_loses():
    env = make_env("memory", n_facts=3, n_turns=6)
    reward, turns, info = play(env, 5, lambda e: e.expert_reply())
    assert reward == 1.0 and turns == 7 and info["correct"] == 3
    reward, _, _ = play(env, 5, lambda e: "<action>ok</action>")
    assert reward == 0.0
    # partial credit: one fact right
    env.reset(5)
    facts = env.state_text().split()
    for _ in range(6):
        env.step("<action>ok</action>")
    assert env.step(f"<action>{facts[0]} room=none</action>").reward == pytest.approx(1 / 3)


def test_memory_facts_arrive_after_the_protected_head():
    env = make_env("memory")
    head = " ".join(m["content"] for m in env.reset(2))
    facts = env.state_text()
    code = facts.split()[0].split("=")[1]
    assert code not in head  # compaction can delete the facts: the head is never deleted
    first = env.step(env.expert_reply()).messages[0]["content"]
    assert code in first


def test_memory_is_seeded():
    a, b = make_env("memory"), make_env("memory")
    a.reset(3)
    b.reset(3)
    assert a.state_text() == b.state_text()
    assert a.step("x") == b.step("y")
    b.reset(4)
    assert a.state_text() != b.state_text()


def test_gsm8k_scores_exact_numbers(gsm8k_path):
    env = make_env("gsm8k", path=gsm8k_path)
    messages = env.reset(0)
    assert messages[-1]["role"] == "user" and len(messages[-1]["content"]) > 20
    assert env.step(env.expert_reply()).reward == 1.0
    assert env.step("I think it is 123456789.").reward == 0.0
    assert extract_answer("so 1,200 in total\n#### 1,200") == "1200"
    assert extract_answer("the answer is 3.50") == "3.5"
    assert extract_answer("no numbers") is None
    with pytest.raises(KVStreamsError, match="not found"):
        make_env("gsm8k", path="/nonexistent.jsonl").reset(0)


def test_gsm8k_trains_on_the_train_split_and_evaluates_on_the_test_split(gsm8k_path, gsm8k_train_path):
    from kvstreams.envs.gsm8k import load_problems

    env = make_env("gsm8k", path=gsm8k_train_path, eval_path=gsm8k_path)
    train_questions = {r["question"] for r in load_problems(gsm8k_train_path)}
    test_questions = {r["question"] for r in load_problems(gsm8k_path)}
    held_out = env.held_out()
    for seed in range(1_000_000, 1_000_020):  # the training loop's eval seeds
        assert held_out.reset(seed)[-1]["content"] in test_questions
    seen = {env.reset(seed)[-1]["content"] for seed in range(40)}
    assert seen <= train_questions and len(seen) == 40  # consecutive seeds: distinct problems
    assert env.reset(7) == make_env("gsm8k", path=gsm8k_train_path).reset(7)  # seeded


def test_gsm8k_eight_shot_prompt(gsm8k_path, gsm8k_train_path):
    env = make_env("gsm8k", path=gsm8k_train_path, eval_path=gsm8k_path, shots=8)
    question = env.held_out().reset(3)[-1]["content"]
    assert question.count("Question: ") == 9 and question.count("####") == 8  # 8 solved + the task
    assert question.endswith("\nAnswer:")
    exemplars = question.split("\n\n")[:8]
    # the exemplars come from the train split and are never training tasks themselves
    train_tasks = {env.reset(seed)[-1]["content"].rsplit("Question: ", 1)[1] for seed in range(200)}
    assert not any(
        e.split("\nAnswer:")[0].removeprefix("Question: ") + "\nAnswer:" in train_tasks for e in exemplars
    )
    with pytest.raises(KVStreamsError, match="shots"):
        make_env("gsm8k", shots=-1)


@pytest.fixture(scope="module")
def tw_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("textworld"))


def test_textworld_expert_wins(tw_cache):
    env = make_env("textworld", cache_dir=tw_cache)
    messages = env.reset(7)
    assert "$$" not in messages[-1]["content"] and "-=" in messages[-1]["content"]
    reward, _, info = play(env, 7, lambda e: e.expert_reply())
    assert reward == pytest.approx(1.0) and info["won"]
    env.close()


def test_textworld_bad_replies_get_the_games_answer(tw_cache):
    env = make_env("textworld", cache_dir=tw_cache)
    env.reset(7)
    for reply in [
        "fly to the moon",
        "",
        "\x18\x10 \\ ~héllo <action>",
        "<state>no action</state>",
        "x" * 500,
    ]:
        result = env.step(reply)
        assert not result.done and result.reward == 0.0
        assert result.messages and result.messages[0]["content"]
    env.close()


def test_chat_continuation_reproduces_the_template(qwen):
    _, tok = qwen
    chat = ChatFormat(tok)
    head = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    reply = "<action>go north</action>"
    obs = [{"role": "user", "content": "You are in a hall."}]
    tokens = chat.head(head) + chat.assistant_header() + chat.encode(reply) + [chat.end_of_turn]
    tokens += chat.after_reply(obs) + chat.assistant_header()
    expected = tok.apply_chat_template(
        [*head, {"role": "assistant", "content": reply}, *obs], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(tokens) == expected


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda story: story.write_bytes(story.read_bytes()[: len(story.read_bytes()) // 2]),  # truncated
        lambda story: story.with_suffix(".json").write_text("{ not json"),
        lambda story: (
            story.with_suffix(".sha256").unlink(),
            story.write_bytes(b"\x03" + story.read_bytes()[1:]),
        ),
    ],
    ids=["truncated story", "bad metadata", "old cache, wrong header"],
)
def test_a_corrupt_cached_game_is_named_and_generated_again(tw_cache, corrupt, capsys):
    from kvstreams.envs.textworld_env import cached_game_problem

    env = make_env("textworld", cache_dir=tw_cache)
    story = env.make_game(7)
    assert cached_game_problem(story) is None
    corrupt(story)
    assert cached_game_problem(story) is not None
    env.reset(7)  # regenerated, then played: never handed to jericho corrupt
    assert f"cached TextWorld game {story} is corrupt" in capsys.readouterr().err
    assert cached_game_problem(story) is None
    reward, _, info = play(env, 7, lambda e: e.expert_reply())
    assert reward == pytest.approx(1.0) and info["won"]
    env.close()


def test_memory_kinds_choose_the_facts_and_bad_kinds_are_refused():
    env = make_env("memory", kinds=["number"], n_turns=2)
    env.reset(5)
    assert list(env.facts) == ["number"] and 10 <= int(env.facts["number"]) <= 99
    for bad in (["colour"], [], ["number", "number"]):
        with pytest.raises(KVStreamsError, match="kinds"):
            make_env("memory", kinds=bad)


def test_recall_with_many_codes_pays_each_code_at_its_place():
    env = make_env("recall", n_filler=1, n_codes=10)
    prompt = env.reset(3)[0]["content"]
    codes = env._codes
    assert len(set(codes)) > 1 and all(f"code {i} is {c}." in prompt for i, c in enumerate(codes, 1))
    expert = env.expert_reply()
    assert env.step(expert).reward == 1.0
    # the first three right, then one missing: the rest are out of place and earn nothing
    partial = " ".join(f"code {i} is {c}." for i, c in enumerate(codes[:3] + codes[4:], 1))
    assert env.step(partial).reward == pytest.approx(0.3)
    assert env.step("I do not know.").reward == 0.0
    assert make_env("recall", n_filler=1, n_codes=10).reset(3) == env.reset(3)  # seeded
    one = make_env("recall", n_filler=1)  # the one-code task is as it was
    one.reset(3)
    assert one.step(one.expert_reply()).reward == 1.0 and "Remember this:" in one.reset(3)[0]["content"]


def _last_reply_before_question(env, seed: int, replies) -> dict:
    env.reset(seed)
    for turn in range(env.n_turns):
        env.step(replies(turn, env))
    return env.step("<state></state><action>none</action>").info


def test_memory_reports_whether_the_last_state_before_the_question_carried_the_facts():
    env = make_env("memory", n_turns=3, n_facts=2)
    assert _last_reply_before_question(env, 1, lambda t, e: e.expert_reply())["carried"] is True
    env.reset(1)
    values = list(env.facts.values())

    def state(text: str, action: str = "ok") -> str:
        return f"<state>{text}</state><action>{action}</action>"

    cases = {  # the replies of turns 0, 1, 2 (the last before the question) -> carried
        "in an earlier state only": ([state(" ".join(values))] * 2 + [state("")], False),
        "one fact of two": ([state(values[0])] * 3, False),
        "in the action": ([state("", " ".join(values))] * 3, False),
        "both, any order, with punctuation": ([state(f"x {values[1]}, {values[0]}.")] * 3, True),
    }
    for name, (replies, expected) in cases.items():
        info = _last_reply_before_question(env, 1, lambda t, e, r=replies: r[t])
        assert info["carried"] is expected, name


def test_memory_copying_expert_carries_the_fact_only_by_chance():
    plain = make_env("memory", n_turns=4, n_facts=1, noise_words=8)
    copying = make_env(
        "memory", n_turns=4, n_facts=1, noise_words=8, expert_carries_state=False, expert_copy_rate=0.5
    )
    carried, states = 0, set()
    for seed in range(600):
        observations = []
        for env in (plain, copying):
            env.reset(seed)
            seen = []
            for _ in range(env.n_turns):
                reply = env.expert_reply()
                seen.append(env.step(reply).messages[0]["content"])
                if env is copying:
                    states.add(reply.split("</state>")[0].removeprefix("<state>"))
            observations.append(seen)
            if env is copying:
                answer = env.expert_reply()
                assert env.facts["color"] in answer  # the answer is read from the full context
                info = env.step(answer).info
                carried += info["carried"]
        assert observations[0] == observations[1]  # the copying draws its own random stream
    # the fact is one of 6 words of its observation, copied with probability 1/2 and kept through
    # two noise turns with probability 1/4: about 2% of episodes
    assert 0.005 < carried / 600 < 0.05
    assert len(states) > 50 and all(" " not in s and "=" not in s for s in states)  # one plain word


def test_memory_copy_rate_is_checked():
    for bad in (-0.1, 1.5):
        with pytest.raises(KVStreamsError, match="expert_copy_rate"):
            make_env("memory", expert_carries_state=False, expert_copy_rate=bad)
    with pytest.raises(KVStreamsError, match="expert_carries_state"):
        make_env("memory", expert_copy_rate=0.5)


def test_memory_fact_turn_moves_the_facts_closer_to_the_question():
    late = make_env("memory", n_turns=4, n_facts=1, noise_words=8, fact_turn=3)
    first = make_env("memory", n_turns=4, n_facts=1, noise_words=8)
    for env in (late, first):
        env.reset(7)
    value = late.facts["color"]
    assert first.facts == late.facts  # the same facts; only their turn moves
    seen, states = [], []
    for _ in range(late.n_turns):
        reply = late.expert_reply()
        states.append(reply)
        seen.append(late.step(reply).messages[0]["content"])
    assert [f"is {value}" in obs for obs in seen] == [False, False, True, False]
    assert seen[-1].startswith("Final question")
    # the carrying expert cannot know the facts before they are stated
    assert value not in states[1] and value not in states[2] and value in states[3]
    assert late.step(late.expert_reply()).reward == 1.0
    with pytest.raises(KVStreamsError, match="fact_turn"):
        make_env("memory", n_turns=4, fact_turn=4)
    with pytest.raises(KVStreamsError, match="fact_turn"):
        make_env("memory", n_turns=4, fact_turn=0)


def test_memory_fact_turns_draw_the_facts_turn_per_episode():
    env = make_env("memory", n_turns=4, n_facts=1, noise_words=8, fact_turns=[1, 2, 3])
    at = []
    for seed in range(60):
        env.reset(seed)
        value = env.facts["color"]
        seen = [env.step(env.expert_reply()).messages[0]["content"] for _ in range(4)]
        assert seen[-1].startswith("Final question")
        (turn,) = [i + 1 for i, obs in enumerate(seen) if f"is {value}" in obs]
        at.append(turn)
        assert env.step(env.expert_reply()).reward == 1.0
    assert set(at) == {1, 2, 3}
    again = make_env("memory", n_turns=4, n_facts=1, noise_words=8, fact_turns=[1, 2, 3])
    again.reset(5)
    env.reset(5)
    assert [again.step("x").messages for _ in range(3)] == [env.step("y").messages for _ in range(3)]
    with pytest.raises(KVStreamsError, match="fact_turn"):
        make_env("memory", n_turns=4, fact_turns=[1, 4])

"""Recall: deleted spans put back into the stream with their archived K/V, recorded as further
visibility intervals and replayed exactly (dense, block-sparse, flex mask structure)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_prompts
from kvstreams import visibility
from kvstreams.engine.stream import StreamSession
from kvstreams.errors import KVStreamsError, TraceFormatError
from kvstreams.policies import make_policy
from kvstreams.replay import replay_logprobs
from kvstreams.sampling import SamplingParams, sample
from kvstreams.trace import FORMAT, FORMAT_RECALL, Trace
from kvstreams.verify import Agreement

META = {"temperature": "1.0", "policy": "full", "mode": "stream", "model": "tiny"}


def decode(session: StreamSession, rows: list[int], n: int, gen: torch.Generator) -> None:
    """``n`` sampled tokens per row, the way episodes write replies."""
    for _ in range(n):
        logits = session.forward(rows)
        for row, row_logits in zip(rows, logits, strict=True):
            tok, lp = sample(row_logits[None], SamplingParams(), gen)
            session.append(row, [int(tok)], sampled=True, loss=True, logprobs=[float(lp)])


def evict_recall_episode(model, policy=None, rows: int = 2, cycles: int = 3) -> list[Trace]:
    """Each row: a prompt, then ``cycles`` times: decode, delete (archived) two spans, decode, recall one
    of them (and part of the other), decode. A recalled span is deleted again in the next cycle."""
    session = StreamSession(model, rows, policy=policy, seed=0)
    gen = torch.Generator().manual_seed(0)
    for row, prompt in enumerate(random_prompts(rows, [40, 33][:rows])):
        session.append(row, prompt)
    all_rows = list(range(rows))
    decode(session, all_rows, 6, gen)
    for cycle in range(cycles):
        for row in all_rows:
            session.delete(row, [(4, 14), (20, 30)], archive=True)
        decode(session, all_rows, 5, gen)
        for row in all_rows:
            assert session.recall(row, 4, 14) >= 0
            session.recall(row, 20, 25 + cycle)  # part of a span: the rest stays archived
        decode(session, all_rows, 5, gen)
    return [session.trace(row, META) for row in all_rows]


def test_recalled_entries_are_seen_again_and_replay_exactly(qwen):
    traces = evict_recall_episode(qwen[0])
    for trace in traces:
        assert trace.metadata["format"] == FORMAT_RECALL and trace.recalls is not None
        # entry 5 died at the first deletion, came back, died again...: three recall intervals
        r = trace.recalls[0, 0, 5]
        assert int((r[:, 0] < r[:, 1]).sum()) == 3
        assert int(trace.death[0, 0, 5]) < int(r[0, 0]) < int(r[0, 1]) <= int(r[1, 0])
        # entries 25.. of the second span came back once they were asked for, never before
        assert int((trace.recalls[0, 0, 29, :, 0] < trace.recalls[0, 0, 29, :, 1]).sum()) == 0
        assert bool(trace.visible_to(len(trace) - 1)[0, 0, 5])  # recalled in the last cycle
    shadow = Agreement.measure(traces, replay_logprobs(qwen[0], traces))
    assert shadow.max_abs_diff <= 1e-4
    blocks = Agreement.measure(traces, replay_logprobs(qwen[0], traces, backend="blocksparse", packed=True))
    assert blocks.max_abs_diff <= 1e-4
    # the recall intervals matter: the same traces without them replay far off
    stripped = [strip_recalls(t) for t in traces]
    assert Agreement.measure(stripped, replay_logprobs(qwen[0], stripped)).max_abs_diff > 1e-3


def strip_recalls(trace: Trace) -> Trace:
    return Trace(
        trace.tokens,
        trace.positions,
        trace.death,
        trace.sampled_mask,
        trace.loss_mask,
        trace.sampler_logprobs,
        {**trace.metadata, "format": FORMAT},
        trace.weights_version,
    )


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_recall_under_per_head_compression_replays_exactly(qwen, policy):
    """Compression evicts per layer and head inside the stream; a recall puts back, per head, only the
    entries that head still held when the span was deleted."""
    traces = evict_recall_episode(qwen[0], policy=make_policy(policy, budget=48, interval=4))
    assert all(tuple(t.death.shape[:2]) != (1, 1) for t in traces)
    assert all(t.recalls is not None for t in traces)
    heads = [t.recalls[..., 0] < t.recalls[..., 1] for t in traces]
    assert any(not bool((h == h[:1, :1]).all()) for h in heads)  # heads recalled different entries
    shadow = Agreement.measure(traces, replay_logprobs(qwen[0], traces))
    assert shadow.max_abs_diff <= 1e-4


def test_recall_trace_round_trips_and_old_readers_refuse_it(qwen, tmp_path):
    trace = evict_recall_episode(qwen[0], rows=1, cycles=1)[0]
    path = trace.save(tmp_path / "t.safetensors")
    loaded = Trace.load(path)
    assert torch.equal(loaded.recalls, trace.recalls) and loaded.metadata["format"] == FORMAT_RECALL
    with pytest.raises(TraceFormatError, match="needs a recalls tensor"):
        strip_recalls(trace).__class__(
            **{**vars(strip_recalls(trace)), "metadata": trace.metadata}
        ).validate()
    with pytest.raises(TraceFormatError, match="cannot hold"):
        Trace(**{**vars(trace), "metadata": {**trace.metadata, "format": FORMAT}}).validate()
    bad = trace.recalls.clone()
    bad[0, 0, 5, 0, 0] = int(trace.death[0, 0, 5]) - 1  # back before the entry died
    with pytest.raises(TraceFormatError, match="previous one's end"):
        Trace(**{**vars(trace), "recalls": bad}).validate()


def test_a_session_that_never_recalls_writes_format_1(qwen):
    session = StreamSession(qwen[0], 1)
    session.append(0, random_prompts(1, 20)[0])
    decode(session, [0], 3, torch.Generator().manual_seed(0))
    session.delete(0, [(2, 8)], archive=True)
    decode(session, [0], 3, torch.Generator().manual_seed(0))
    trace = session.trace(0, META)
    assert trace.recalls is None and trace.metadata["format"] == FORMAT
    assert session.counters.archive_peak_bytes > 0


def test_dense_mask_and_counts_with_recall_intervals():
    death = torch.tensor([6, 2, 6, 4, 6, 6], dtype=torch.int32)
    recalls = torch.zeros(6, 1, 2, dtype=torch.int32)
    recalls[1, 0] = torch.tensor([4, 6])  # entry 1: seen by 1, then by 4 and 5 again
    mask = visibility.dense(death, recalls)
    assert mask[:, 1].tolist() == [False, True, False, False, True, True]
    assert mask[:, 3].tolist() == [False, False, False, True, False, False]
    assert torch.equal(visibility.visible_counts(death, recalls), mask.sum(-1))


def test_block_summaries_cover_every_recalled_pair():
    """The block table never drops a visible pair and never calls a block full that is not."""
    from kvstreams.replay.masks import block_visibility

    T, bs = 64, 8
    g = torch.Generator().manual_seed(0)
    j = torch.arange(T)
    death = (j + 1 + torch.randint(0, 20, (T,), generator=g)).clamp(max=T).to(torch.int32)
    start = (death + torch.randint(0, 20, (T,), generator=g)).clamp(max=T)
    end = (start + torch.randint(0, 10, (T,), generator=g)).clamp(max=T)
    recalls = torch.stack([start, end], -1)[:, None].to(torch.int32)
    recalls = torch.where(recalls[..., :1] < recalls[..., 1:], recalls, 0)
    mask = visibility.dense(death, recalls)
    blocks = mask.view(T // bs, bs, T // bs, bs)
    any_visible, full = block_visibility(death[None, None], bs, recalls[None, None])
    assert bool((blocks.any(-1).any(1) <= any_visible[0, 0]).all())
    assert bool((full[0, 0] <= blocks.all(-1).all(1)).all())


@pytest.mark.flex
def test_flex_replays_recall_intervals(qwen):
    """The flex BlockMask (its block table and its mask_mod) sees the recall intervals too."""
    traces = evict_recall_episode(qwen[0], policy=make_policy("snapkv", budget=48, interval=4))
    flex = replay_logprobs(qwen[0], traces, backend="flex")
    assert Agreement.measure(traces, flex).max_abs_diff <= 1e-4


def recall_episodes(qwen, strategy: str, mode: str, how: str, **options):
    """test_episodes' memory episodes with a lexical recall that fires on any shared word."""
    from kvstreams.compaction.recall import make_recall
    from test_episodes import run

    return run(qwen, strategy, mode, recall=make_recall("lexical", min_score=0.0, how=how), **options)


@pytest.mark.parametrize("strategy", ["markovian", "sliding_window"])
def test_episodes_that_recall_replay_exactly(qwen, strategy):
    results, cost = recall_episodes(qwen, strategy, "stream", "archive")
    traces = [t for r in results for t in r.traces]
    assert cost.recalls >= 4 and cost.kv_archive_peak_bytes > 0
    assert all(t.recalls is not None for t in traces)
    assert Agreement.measure(traces, replay_logprobs(qwen[0], traces)).max_abs_diff <= 1e-4
    for trace in traces:  # each recalled span is seen by the query right after the recall
        events = json.loads(trace.metadata["recall_events"])
        assert events and all(e["how"] == "archive" for e in events)
        for event in events:
            start, end = event["span"]
            later = trace.recalls[0, 0, start:end]
            assert bool((later[..., 0] < later[..., 1]).any(-1).all())


def test_recompute_feeds_the_tokens_again_and_needs_no_intervals(qwen):
    results, cost = recall_episodes(qwen, "markovian", "reprefill", "recompute")
    traces = [t for r in results for t in r.traces]
    assert cost.recalls >= 4 and cost.kv_archive_peak_bytes == 0
    assert all(t.recalls is None for t in traces)
    assert Agreement.measure(traces, replay_logprobs(qwen[0], traces)).max_abs_diff <= 1e-4


def test_recall_settings_that_cannot_work_are_refused(qwen):
    from kvstreams.compaction import make_strategy
    from kvstreams.compaction.recall import make_recall
    from kvstreams.episodes import EpisodeRunner
    from kvstreams.errors import KVStreamsError

    markovian = make_strategy("markovian")
    with pytest.raises(KVStreamsError, match="re-prefill keeps no K/V"):
        EpisodeRunner(*qwen, markovian, mode="reprefill", recall=make_recall("lexical"))
    with pytest.raises(KVStreamsError, match="deletes nothing"):
        EpisodeRunner(*qwen, None, mode="full", recall=make_recall("lexical"))
    with pytest.raises(KVStreamsError, match="unknown recall"):
        make_recall("oracle")


def test_lexical_recall_prefers_the_unit_sharing_rare_words():
    from kvstreams.compaction.recall import make_recall

    recall = make_recall("lexical")
    deleted = ["Remember: the color is red.", "Turn 2. lamp river ok.", "Turn 3. stone lamp ok."]
    assert recall.choose(deleted, "Final question: what is the color?") == [0]
    assert recall.choose(deleted, "Turn 4. ok") == []  # only words every unit (or none) holds
    assert make_recall("lexical", max_units=2).choose(deleted, "the lamp river") == [0, 1]


@pytest.mark.parametrize("backend", ["sdpa", "blocksparse"])
def test_a_learner_step_on_recalled_episodes_is_on_policy(qwen, model_dirs, tmp_path, backend):
    """Training end to end (config -> rollouts with recall -> learner): the first update's ratio is 1
    and the sampler/learner mismatch is nil, on either CPU backend."""
    from kvstreams.train.rollouts import RolloutSource
    from test_train import learner_step_then_restore, small_config

    sets = {
        "rollout.recall": '"lexical"',
        "rollout.recall_args": "{min_score = 0.0}",
        "rollout.group_size": 4,
        "train.backend": f'"{backend}"',
    }
    cfg = small_config(model_dirs["qwen3"], tmp_path, **sets)
    batch = RolloutSource(*qwen, cfg).collect(step=0)
    assert batch.stats.recalls > 0 and any(s.trace.recalls is not None for s in batch.samples)
    metrics = learner_step_then_restore(qwen[0], cfg, batch)
    assert metrics["mismatch/abs_logprob_diff_max"] < 1e-4
    assert metrics["ratio/first_update_max_abs_dev"] < 1e-4


def test_recall_configs_that_cannot_work_are_refused_before_loading(model_dirs, tmp_path):
    from test_train import small_config

    with pytest.raises(KVStreamsError, match="re-prefill keeps no K/V"):
        small_config(
            model_dirs["qwen3"],
            tmp_path,
            **{"rollout.recall": '"lexical"', "rollout.mode": '"reprefill"', "loss.type": '"reprefill"'},
        )
    with pytest.raises(KVStreamsError, match="unknown recall"):
        small_config(model_dirs["qwen3"], tmp_path, **{"rollout.recall": '"oracle"'})


def test_a_model_trigger_takes_its_query_from_the_reply_tag_only():
    from kvstreams.compaction.recall import make_recall

    asked = make_recall("lexical", trigger="model")
    reply = (
        "<state></state><recall>the color</recall> then <recall>remember color</recall><action>ok</action>"
    )
    assert asked.query("Final question: what is the color?", reply) == "remember color"  # the last tag
    assert asked.query("Final question: what is the color?", "<action>ok</action>") is None
    assert make_recall("lexical").query("the observation", reply) == "the observation"
    assert make_recall("lexical", trigger="model", tag="mem").query("x", "<mem>lamp</mem>") == "lamp"
    assert asked.describe()["trigger"] == "model" and "trigger" not in make_recall("lexical").describe()
    with pytest.raises(KVStreamsError, match="trigger 'policy'"):
        make_recall("lexical", trigger="policy")
    with pytest.raises(KVStreamsError, match="recall tag"):
        make_recall("lexical", trigger="model", tag="<recall>")


@pytest.mark.parametrize("asks", [False, True])
def test_the_policy_asks_for_a_deleted_unit_and_the_replay_stays_exact(qwen, monkeypatch, asks):
    """Trigger "model": a reply that writes <recall>remember color</recall> (forced here as the reply's
    first tokens: the tiny models never write it) brings the fact's unit back; without the tag, nothing
    comes back, however much the observations share with the deleted units."""
    from kvstreams.compaction.recall import make_recall
    from kvstreams.episodes import EpisodeRunner
    from test_episodes import run

    ask = qwen[1].encode("<recall>remember color</recall>", add_special_tokens=False)
    start_reply = EpisodeRunner._start_reply
    if asks:
        monkeypatch.setattr(
            EpisodeRunner, "_start_reply", lambda self, ep, forced=None: start_reply(self, ep, forced or ask)
        )
    recall = make_recall("lexical", min_score=0.0, trigger="model")
    results, cost = run(qwen, "markovian", "stream", recall=recall)
    traces = [t for r in results for t in r.traces]
    assert Agreement.measure(traces, replay_logprobs(qwen[0], traces)).max_abs_diff <= 1e-4
    if not asks:
        assert cost.recalls == 0 and all(t.recalls is None for t in traces)
        return
    assert cost.recalls >= 2
    for trace in traces:
        events = json.loads(trace.metadata["recall_events"])
        assert events and all(e["query"] == "remember color" for e in events)
        recalled = [qwen[1].decode(trace.tokens[s:e].tolist()) for s, e in (ev["span"] for ev in events)]
        assert any("Remember:" in text for text in recalled)  # the fact's unit, by its rare words


def test_a_units_own_recall_requests_are_not_matched():
    from kvstreams.compaction.recall import make_recall

    asked = make_recall("lexical", trigger="model", min_score=0.0)
    deleted = [
        "Remember: the color is red.",
        "<recall>the color</recall><action>ok</action>",
        "Turn 3. lamp.",
    ]
    assert asked.choose([asked.content(d) for d in deleted], "the color") == [0]
    assert asked.choose(deleted, "the color") == [1]  # matched as written: a tie, and the newest wins

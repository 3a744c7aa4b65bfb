"""The trace file: round trip, validation with clear messages, atomic writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvstreams.errors import TraceFormatError
from kvstreams.trace import FORMAT, Trace, compact_death


def make_trace(T: int = 10, L: int = 2, H: int = 2) -> Trace:
    death = torch.full((L, H, T), T, dtype=torch.int32)
    death[0, 1, 2] = 6
    death[1, 0, 3] = 4
    sampled = torch.zeros(T, dtype=torch.bool)
    sampled[4:] = True
    lp = torch.full((T,), math.nan)
    lp[4:] = -torch.rand(T - 4)
    return Trace(
        tokens=torch.arange(T, dtype=torch.long) + 3,
        positions=torch.arange(T, dtype=torch.long),
        death=death,
        sampled_mask=sampled,
        loss_mask=sampled.clone(),
        sampler_logprobs=lp.float(),
        weights_version=torch.zeros(T, dtype=torch.int32),
        metadata={"format": FORMAT, "temperature": "1.0", "policy": "snapkv", "mode": "stream", "model": "m"},
    )


def test_round_trip(tmp_path):
    trace = make_trace()
    path = trace.save(tmp_path / "t.safetensors")
    loaded = Trace.load(path)
    for name in ("tokens", "positions", "death", "sampled_mask", "loss_mask", "weights_version"):
        assert torch.equal(getattr(loaded, name), getattr(trace, name))
    assert torch.equal(loaded.sampler_logprobs.isnan(), trace.sampler_logprobs.isnan())
    m = trace.sampled_mask
    assert torch.equal(loaded.sampler_logprobs[m], trace.sampler_logprobs[m])
    assert loaded.metadata == trace.metadata
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]  # no temp files left


def test_files_written_before_the_weights_version_rename_still_load(tmp_path):
    trace = make_trace()
    trace.weights_version = torch.arange(len(trace), dtype=torch.int32)
    tensors = trace.tensors()
    tensors["policy_version"] = tensors.pop("weights_version")  # the name earlier files used
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=trace.metadata)
    loaded = Trace.load(tmp_path / "old.safetensors")
    assert torch.equal(loaded.weights_version, trace.weights_version)


def test_visibility_semantics():
    trace = make_trace()
    vis = trace.visible(layer=0, head=1)
    # entry 2 dies at query 6: visible to queries 2..5 only
    assert vis[2:6, 2].all() and not vis[6:, 2].any() and not vis[:2, 2].any()
    assert vis[9, 9] and not vis[3, 4]  # causal
    assert trace.visible(1, 0)[3, 3] and not trace.visible(1, 0)[4, 3]


def test_compact_death():
    d = torch.full((3, 2, 5), 5, dtype=torch.int32)
    assert compact_death(d).shape == (1, 1, 5)
    d[1, 0, 0] = 2
    assert compact_death(d).shape == (3, 2, 5)
    d2 = torch.full((3, 2, 5), 5, dtype=torch.int32)
    d2[:, 1, 0] = 2
    assert compact_death(d2).shape == (1, 2, 5)
    assert torch.equal(compact_death(d2).expand(3, 2, 5), d2)


def _corrupt(tmp_path: Path, edit) -> Path:
    trace = make_trace()
    tensors = trace.tensors()
    metadata = dict(trace.metadata)
    edit(tensors, metadata)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, m: t.pop("death"), "missing tensor 'death'"),
        (lambda t, m: t.__setitem__("tokens", t["tokens"].int()), "dtype"),
        (lambda t, m: t.__setitem__("positions", t["positions"][:5]), "shape"),
        (lambda t, m: t["death"].__setitem__((0, 0, 7), 7), "death\\[..., 7\\] <= 7"),
        (lambda t, m: t["death"].__setitem__((0, 0, 7), 99), "exceed"),
        (lambda t, m: t.__setitem__("death", t["death"][:, :, :4].contiguous()), "death has shape"),
        (lambda t, m: m.__setitem__("format", "kvstreams-trace/0"), "format"),
        (lambda t, m: m.pop("temperature"), "missing temperature"),
        (lambda t, m: m.__setitem__("temperature", "hot"), "temperature"),
        (lambda t, m: t["sampler_logprobs"].__setitem__(6, float("nan")), "finite"),
        (lambda t, m: t["sampler_logprobs"].__setitem__(6, float("-inf")), "finite"),
        (lambda t, m: m.__setitem__("temperature", "nan"), "temperature 'nan'"),
        (lambda t, m: m.__setitem__("temperature", "inf"), "temperature 'inf'"),
        (lambda t, m: t["tokens"].__setitem__(2, -1), "token ids must be >= 0"),
        (lambda t, m: t["sampler_logprobs"].__setitem__(1, -0.5), "NaN where"),
        (lambda t, m: t.__setitem__("extra", torch.zeros(3)), "unexpected tensor"),
    ],
)
def test_inconsistent_traces_are_rejected(tmp_path, edit, message):
    path = _corrupt(tmp_path, edit)
    with pytest.raises(TraceFormatError, match=message):
        Trace.load(path)


def test_corrupt_and_missing_files(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01not a safetensors file at all")
    with pytest.raises(TraceFormatError, match="not a readable safetensors"):
        Trace.load(junk)
    good = make_trace().save(tmp_path / "good.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-20])
    with pytest.raises(TraceFormatError):
        Trace.load(truncated)
    with pytest.raises(TraceFormatError, match="does not exist"):
        Trace.load(tmp_path / "nope.safetensors")


def test_invalid_trace_is_not_written(tmp_path):
    trace = make_trace()
    trace.death[0, 0, 5] = 3
    with pytest.raises(TraceFormatError):
        trace.save(tmp_path / "t.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_death_must_fit_the_model():
    trace = make_trace(L=2, H=2)
    assert trace.death_for(2, 2).shape == (2, 2, 10)
    with pytest.raises(TraceFormatError, match="does not fit"):
        trace.death_for(4, 2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.tokens.__setitem__(3, 10**6), "outside the model's vocabulary"),
        (lambda t: t.positions.__setitem__(slice(None), t.positions + 10**6), "max_position_embeddings"),
    ],
)
def test_traces_that_do_not_fit_the_model_are_refused_at_replay(qwen, edit, message):
    from kvstreams.replay import replay_logprobs

    model, _ = qwen
    trace = make_trace()
    trace.death = trace.death[:1]  # one layer's record, shared by all: fits the 2-KV-head model
    edit(trace)
    with pytest.raises(TraceFormatError, match=message):
        replay_logprobs(model, [trace])


# --- a digest of the payload: a flipped byte that stays in range is caught ------------------------------


def _flip_death_byte(path: Path) -> None:
    """Lower one ``death`` value by one inside the file: still a valid record, another visibility."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        death = f.get_tensor("death")
    data = bytearray(path.read_bytes())
    needle = death.numpy().tobytes()
    at = bytes(data).index(needle)
    j = int((death[0, 0] > torch.arange(death.shape[-1]) + 1).nonzero()[0])  # an entry that can die earlier
    offset = at + 4 * j  # int32, [0, 0, j]
    value = int.from_bytes(data[offset : offset + 4], "little") - 1
    data[offset : offset + 4] = value.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    assert meta is not None


def test_a_trace_carries_a_digest_and_an_altered_payload_is_refused(tmp_path):
    path = make_trace().save(tmp_path / "t.safetensors")
    assert Trace.load(path).metadata.get("digest") is None  # checked and set aside, not part of the record
    _flip_death_byte(path)
    with pytest.raises(TraceFormatError, match="digest"):
        Trace.load(path)


def test_altered_metadata_is_refused_too(tmp_path):
    import json

    path = make_trace().save(tmp_path / "t.safetensors")
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"]["temperature"] = "0.5"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(raw) == size
    path.write_bytes(data[:8] + raw + data[8 + size :])
    with pytest.raises(TraceFormatError, match="digest"):
        Trace.load(path)


def test_a_trace_written_before_digests_loads_with_a_warning(tmp_path):
    trace = make_trace()
    save_file(trace.tensors(), str(tmp_path / "old.safetensors"), metadata=trace.metadata)
    with pytest.warns(UserWarning, match="no digest"):
        loaded = Trace.load(tmp_path / "old.safetensors")
    assert torch.equal(loaded.death, trace.death)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.positions.__setitem__(slice(2, 4), torch.tensor([3, 2])), "positions"),
        (lambda t: t.positions.zero_(), "positions"),
        (lambda t: t.metadata.__setitem__("mode", "streaming"), "mode 'streaming'"),
    ],
)
def test_stream_positions_and_the_mode_are_checked(edit, message, tmp_path):
    trace = make_trace()
    edit(trace)
    with pytest.raises(TraceFormatError, match=message):
        trace.save(tmp_path / "t.safetensors")

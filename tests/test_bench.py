"""The benchmarks measure what they say: counters, memory probes, reports. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvstreams.bench.learner import LearnerBenchSettings, _slicing, bench_learner, synthetic_trace
from kvstreams.bench.report import measure_peak, peak_memory_supported
from kvstreams.bench.rollout import Point, RolloutBenchSettings, bench_rollout
from kvstreams.cli import main
from kvstreams.train.config import Config
from kvstreams.visibility import dense as dense_visibility

needs_peak = pytest.mark.skipif(not peak_memory_supported(), reason="needs /proc/self/clear_refs (Linux)")


@pytest.fixture
def bench_models(tmp_path, model_dirs) -> Path:
    """A bench models directory whose `tiny` is the session's qwen3 tiny model (the same recipe)."""
    root = tmp_path / "models"
    root.mkdir()
    (root / "tiny").symlink_to(Path(model_dirs["qwen3"]).resolve())
    return root


@needs_peak
def test_measure_peak_sees_an_allocation_and_not_its_absence():
    with measure_peak() as big:
        x = torch.ones(16 * 2**20)  # 64 MiB, touched
        del x
    with measure_peak() as small:
        y = torch.ones(1024)
        del y
    assert big.extra >= 60 * 2**20
    assert small.extra < 8 * 2**20


@needs_peak
def test_physical_slicing_spikes_and_the_mask_does_not():
    rows = _slicing(LearnerBenchSettings(slice_tokens=4096), step=lambda _: None)
    slicing, mask = rows
    assert slicing["peak / KV"] > 1.4  # the kept half is allocated while the whole is still alive
    assert mask["peak / KV"] < 1.1
    assert slicing["resident after MB"] == pytest.approx(slicing["KV MB before"] / 2)


def test_synthetic_record_keeps_sinks_and_a_window_per_head():
    trace = synthetic_trace(512, n_layers=2, n_kv_heads=2, vocab=100, seed=0)
    death = trace.death_for(2, 2)
    visible = dense_visibility(death)  # [L, H, T, T]
    assert bool(visible[..., -1, :4].all())  # sinks are seen by the last query
    seen = visible[..., -1, :].sum(-1)
    assert int(seen.max()) <= 4 + 512 // 4
    assert len({int(s) for s in seen.flatten()}) > 1  # heads differ


def test_rollout_bench_counts_reprefill_and_stream(tmp_path, bench_models):
    settings = RolloutBenchSettings(
        points=[Point("tiny", "memory", "sliding_window", 160, episodes=2, turns=8)],
        max_reply_tokens=8,
        kv_turns=[3, 6],
        compose=[("snapkv", 96)],
    )
    report = bench_rollout(settings, bench_models, tmp_path / "out")
    runs = {r["mode"]: r for r in report.sections[0].rows}
    assert set(runs) == {"stream", "reprefill", "full"}
    assert runs["stream"]["re-prefilled"] == 0
    assert runs["reprefill"]["re-prefilled"] > 0
    assert runs["reprefill"]["tokens fwd"] == pytest.approx(
        runs["stream"]["tokens fwd"] + runs["reprefill"]["re-prefilled"], rel=0.15
    )
    assert runs["stream"]["peak KV entries"] < runs["full"]["peak KV entries"]
    ratio = report.sections[1].rows[0]
    assert ratio["tokens reprefill/stream"] > 1
    assert ratio["filler b=1"] == 0 and ratio["filler b=16"] > 0
    (both,) = report.sections[3].rows  # compaction + compression, next to compaction alone
    assert both["policy"] == "snapkv 96" and both["peak KV entries"] < 96
    assert both["KV entries rel"] < 1 and both["peak KV entries"] < runs["stream"]["peak KV entries"]
    growth = report.sections[2].rows
    full = [g["peak KV entries"] for g in growth if g["mode"] == "full"]
    assert full[1] > full[0]  # full context grows with the episode
    assert {t.name for t in report.targets} >= {"stream re-prefills"}
    for plot in report.plots:
        assert Path(plot).stat().st_size > 0
    saved = json.loads(report.save(tmp_path / "r.json").read_text())
    assert saved["machine"]["torch"] == torch.__version__
    assert [r["mode"] for r in saved["sections"][0]["rows"]] == [r["mode"] for r in report.sections[0].rows]


def test_rollout_curve_plays_every_budget_at_every_length_without_full_context(
    tmp_path, bench_models, capsys
):
    out = tmp_path / "curve"
    args = ["bench", "rollout", "--curve", "--quick", "--out", str(out), "--models", str(bench_models)]
    assert main([*args, "--json", str(tmp_path / "c.json")]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    runs, ratios = report["sections"][0]["rows"], report["sections"][1]["rows"]
    assert {r["mode"] for r in runs} == {"stream", "reprefill"}  # the curve leaves full context out
    points = {(r["B"], r["turns"]) for r in ratios}
    assert points == {(b, t) for b in (192, 256) for t in (6, 12)}
    assert all(r["wall full/stream"] is None and r["tokens reprefill/stream"] > 1 for r in ratios)
    assert (out / "rollout-curve-quick.json").is_file() and (out / "rollout_curve.png").stat().st_size > 0
    assert main(["bench", "learner", "--curve", "--quick", "--out", str(out)]) == 2
    assert "--curve is for bench rollout" in capsys.readouterr().err


def test_bench_decode_cli_writes_json(tmp_path, bench_models, capsys):
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "decode",
            "--quick",
            "--out",
            str(out),
            "--models",
            str(bench_models),
            "--json",
            str(tmp_path / "d.json"),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "d.json").read_text())
    rows = report["sections"][0]["rows"]
    engines = [(r["engine"], r["policy"]) for r in rows]
    assert ("HF generate", "-") in engines and ("kvstreams", "full") in engines
    settings = report["settings"]
    # every engine decoded the same tokens: batch x new tokens
    assert {r["tokens"] for r in rows} == {settings["batches"][0] * settings["new_tokens"]}
    compressed = next(r for r in rows if r["policy"].startswith("snapkv"))
    full = next(r for r in rows if r["policy"] == "full")
    hf = next(r for r in rows if r["engine"] == "HF generate")
    assert compressed["KV MB"] == pytest.approx(full["KV MB"] * settings["budget"], rel=0.05)
    for r in rows:
        assert r["vs HF generate"] == pytest.approx(r["tokens/s"] / hf["tokens/s"])
    assert json.loads((out / "decode-quick.json").read_text()) == report  # --json writes the saved report
    assert (out / "decode.png").is_file()
    assert "vs HF generate" in capsys.readouterr().out


def test_bench_on_a_given_model_decodes_at_three_batch_sizes_and_premise_runs(tmp_path, bench_models, capsys):
    tiny = bench_models / "tiny"
    assert (
        main(
            [
                "bench",
                "decode",
                "--model",
                str(tiny),
                "--out",
                str(tmp_path),
                "--json",
                str(tmp_path / "d.json"),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "d.json").read_text())["sections"][0]["rows"]
    assert sorted({r["batch"] for r in rows}) == [1, 8, 32]
    assert {r["model"] for r in rows} == {"tiny"}
    assert main(["bench", "premise", "--quick", "--out", str(tmp_path), "--models", str(bench_models)]) == 0
    premise = json.loads((tmp_path / "premise-quick.json").read_text())
    rows = premise["sections"][0]["rows"]
    assert [r["policy"] for r in rows] == ["full", "snapkv", "recent"]
    assert (
        all(r["shadow max|Δ|"] <= 1e-4 for r in rows)
        and rows[0]["dense KL k3"] < 1e-9 < rows[1]["dense KL k3"]
    )
    assert 0.4 < rows[1]["KV saving"] < 0.55  # 50% of each sequence dropped
    assert rows[0]["KV saving"] == 0 and [r["dropped"] for r in rows] == [0.0, 0.5, 0.5]
    assert all(r["accuracy"] == 0.0 for r in rows)  # a random model never writes the four-digit code
    assert all(r["shadow KL k3"] < 1e-9 for r in rows)  # the plot's shadow line: the replay's own KL
    assert main(["bench", "rollout", "--model", str(tiny), "--out", str(tmp_path)]) == 2
    assert "--model is for decode, learner and premise" in capsys.readouterr().err


def test_flex_training_on_cpu_is_refused_up_front():
    with pytest.raises(ValueError, match="no backward on CPU"):
        Config.model_validate({"train": {"backend": "flex"}, "model": {"device": "cpu"}})


def test_bench_learner_on_a_given_model_reports_replay_and_no_empty_step_section(tmp_path, bench_models):
    settings = LearnerBenchSettings.preset(quick=True).on_model(str(bench_models / "tiny"))
    settings = dataclasses.replace(settings, lengths=[128], backends=["causal", "sdpa"], slice_tokens=512)
    report = bench_learner(settings, bench_models, tmp_path).as_dict()
    titles = [s["title"] for s in report["sections"]]
    assert not any("GRPO learner step" in t for t in titles)  # the step section runs the tiny model only
    replay = report["sections"][0]["rows"]
    assert [(r["backend"], r["pass"]) for r in replay] == [
        ("causal", "forward"),
        ("causal", "forward+backward"),
        ("sdpa", "forward"),
        ("sdpa", "forward+backward"),
    ]
    assert all(r["seconds"] > 0 for r in replay)
    if peak_memory_supported():  # each pass's peak over the causal learner's, for the same pass
        causal = {r["pass"]: r["peak MB"] for r in replay if r["backend"] == "causal"}
        for r in replay:
            assert r["peak / causal"] == pytest.approx(r["peak MB"] / causal[r["pass"]])


def test_flop_model_counts_every_linear_weight_and_the_visible_keys(qwen):
    from kvstreams.bench.roofline import FlopModel
    from kvstreams.models import model_shape

    model, _ = qwen
    cfg, shape = model.config, model_shape(model)
    inter, d, hd = cfg.intermediate_size, cfg.hidden_size, shape.head_dim
    per_layer = d * shape.n_heads * hd * 2 + d * shape.n_kv_heads * hd * 2 + 3 * d * inter  # q, o, k, v; MLP
    flops = FlopModel.of(model)
    assert flops.linear_params == shape.n_layers * per_layer + d * shape.vocab_size  # + the LM head
    assert flops.forward(10, 0) == 10 * 2 * flops.linear_params
    assert flops.forward(1, 100) - flops.forward(1, 0) == 100 * 4 * shape.n_layers * shape.n_heads * hd


def test_bench_roofline_quick_reports_peak_phases_profile_and_targets(tmp_path, bench_models):
    from kvstreams.bench.llama_cpp import missing

    out = tmp_path / "bench"
    assert main(["bench", "roofline", "--quick", "--out", str(out), "--models", str(bench_models)]) == 0
    report = json.loads((out / "roofline-quick.json").read_text())
    peaks, phases, profile, steps = (s["rows"] for s in report["sections"])
    peak = report["settings"]["peak tiny"]
    assert peak["fp32 GFLOP/s"] == max(r["GFLOP/s"] for r in peaks if r["dtype"] == "float32")
    assert peak["bandwidth GB/s"] > 0
    assert {r["phase"] for r in phases} == {"prefill", "decode", "decode snapkv 50%", "learner fwd+bwd"}
    for r in phases:
        assert r["MFU fp32"] == pytest.approx(r["GFLOP/s"] / peak["fp32 GFLOP/s"])
        assert r["tokens/s"] == pytest.approx(r["tokens"] / r["seconds"])
    shares = [sum(v for k, v in r.items() if k.endswith("%")) for r in profile]
    assert shares == pytest.approx([100.0] * len(profile), abs=0.5)  # the parts add up to the wall-clock
    assert any(r["attention %"] > 0 and r["linear %"] > 0 for r in profile)
    assert {t["name"].split(":")[0] for t in report["targets"]} >= {"learner forward + backward"}
    variants = {r["variant"]: r for r in steps}
    assert set(variants) == {"fp32", "bf16", "fp32 + LoRA r=8"}
    for name in ("fp32", "fp32 + LoRA r=8"):  # the replay stays exact in fp32, with or without LoRA
        assert variants[name]["shadow max |Δ log p|"] < 1e-4
    assert all(r["step s"] == pytest.approx(r["rollout s"] + r["learner s"]) for r in steps)
    assert (out / "roofline-tiny.png").is_file()
    assert missing(None).startswith("not run: pass --llama-cpp")
    assert "not built" in missing(tmp_path)
    assert main(["bench", "decode", "--quick", "--llama-cpp", str(tmp_path), "--out", str(out)]) == 2


def test_llama_cpp_side_parses_batched_bench_and_survives_a_crashing_precision(tmp_path):
    """Fake llama.cpp tools: quantize copies, batched-bench prints its JSON lines for F32 and BF16 and
    dies of SIGILL on Q4_1 (as AMX kernels do in this machine's VM): rows for the two, a note for it."""
    from types import SimpleNamespace

    from kvstreams.bench.llama_cpp import llama_cpp_rows

    bin_dir = tmp_path / "llama" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-quantize").write_text('#!/bin/sh\ncp "$2" "$3"\n')
    line = '{"pl": %s, "speed_tg": 50.0, "speed_pp": 900.0}'
    (bin_dir / "llama-batched-bench").write_text(
        '#!/bin/sh\ncase "$2" in *Q4_1*) kill -ILL $$;; esac\n'
        + "".join(f"echo '{line % b}'\n" for b in (1, 8))
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    source = tmp_path / "m.Q4_1.gguf"
    source.write_text("gguf")
    settings = SimpleNamespace(llama_cpp=str(tmp_path / "llama"), prompt_len=8, new_tokens=4, batches=[1, 8])
    ours = [
        {"phase": "decode", "batch": 1, "tokens/s": 25.0},
        {"phase": "decode", "batch": 8, "tokens/s": 100.0},
    ]
    rows = llama_cpp_rows(settings, "m", source, ours, tmp_path / "out").rows
    measured = [(r["precision"], r["batch"], r["kvstreams fp32 / this"]) for r in rows if "batch" in r]
    assert measured == [("F32", 1, 0.5), ("F32", 8, 2.0), ("BF16", 1, 0.5), ("BF16", 8, 2.0)]
    assert (tmp_path / "out" / "models" / "m.F32.gguf").is_file()
    failed = [r for r in rows if r.get("precision") == "Q4_1"]
    assert len(failed) == 1 and failed[0]["note"].startswith("failed (signal 4)")
    assert llama_cpp_rows(settings, "tiny", None, ours, tmp_path).rows[0]["note"] == "no GGUF of this model"

"""The samplers' traces are bit-for-bit what they were for every setting that predates recall and the
one-sampler work (tests/trace_hashes.py says how they were recorded and how to re-record them)."""

from __future__ import annotations

import json

import pytest
import torch

from trace_hashes import GOLDEN, environment, fingerprints


def test_every_existing_setting_samples_the_same_traces(qwen):
    golden = json.loads(GOLDEN.read_text())
    here = environment()
    if {k: golden[k] for k in here} != here:
        pytest.skip(f"fingerprints were recorded on {golden['torch']} / {golden['cpu']}, this is {here}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded: a reduction's order must not depend on the thread count
    try:
        found = fingerprints(*qwen)
    finally:
        torch.set_num_threads(threads)
    changed = sorted(k for k in golden["hashes"] if found.get(k) != golden["hashes"][k])
    assert not changed, f"these settings sample other traces than before: {changed}"

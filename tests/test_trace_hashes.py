"""The samplers' traces are bit-for-bit what they were for every setting that predates recall and the
one-sampler work (tests/trace_hashes.py says how they were recorded and how to re-record them)."""

from __future__ import annotations

import pytest
import torch

from trace_hashes import environment, fingerprints, golden_for


def test_every_existing_setting_samples_the_same_traces(qwen):
    here = environment()
    golden = golden_for(here)
    if golden is None:
        pytest.skip(f"no fingerprints were recorded on {here} (tests/data/trace_hashes.json)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded: a reduction's order must not depend on the thread count
    try:
        found = fingerprints(*qwen)
    finally:
        torch.set_num_threads(threads)
    changed = sorted(k for k in golden["hashes"] if found.get(k) != golden["hashes"][k])
    assert not changed, f"these settings sample other traces than before: {changed}"

"""The project's own end-to-end reproducibility checks, through its pytest plugin."""
from __future__ import annotations

import pytest

from divergence.testing import assert_reproducible

PROMPTS = ["Return the number of", "This module provides", "The socket module provides", "Create a new"]


def test_batch_invariant_kernels_make_every_schedule_agree_with_spec_decoding():
    reports = assert_reproducible(None, PROMPTS, schedules=("serial", "concurrent", "warm"),
                                  policy="batch-invariant", spec_k=3, max_tokens=24)
    assert all(r.identical for r in reports.values())


@pytest.mark.reproducible(prompts=PROMPTS[:2], policy="batch-invariant", max_tokens=16)
def test_marker_form():
    pass

"""The demo's traces and a `--tp 2` run's, column for column (timing aside), equal what
they were when pinned: moves of code and speed changes must not change what is recorded.
See pinned.py for why the pins hold on any x86-64 CPU."""
from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest

from . import pinned


@pytest.fixture(scope="module")
def pins():
    p = json.loads(pinned.PINS.read_text())
    if p["where"] != pinned.where():
        pytest.skip(f"traces pinned under {p['where']}, this is {pinned.where()}: MLX's kernels may differ "
                    f"there (re-pin with `python -m tests.trace.pinned --write` after checking the change)")
    return p["runs"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """name -> (its output dir, schedule -> digest), each run once."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            done[name] = out, pinned.record(name, out)
        return done[name]
    return get


@pytest.mark.parametrize("name", sorted(pinned.RUNS))
def test_traces_equal_their_pins(name, pins, recorded):
    _, got = recorded(name)
    assert set(got["serial"]) == set(pins[name]["serial"]), "the schema's tables changed: re-pin"
    changed = [f"{s}/{table}" for s in got for table in got[s] if got[s][table] != pins[name][s][table]]
    assert not changed, f"{name}: these recorded tables changed: {', '.join(changed)}"


def test_one_changed_value_is_caught(recorded, tmp_path):
    """The digest reads every column: a trace with one logit moved by one ulp digests differently,
    in that table only."""
    out, got = recorded("demo")
    path = tmp_path / "serial.h5"
    shutil.copy(out / "serial.h5", path)
    with h5py.File(path, "r+") as f:
        row = f["tokens"][0]
        row["topk_logits"][0] = np.nextafter(row["topk_logits"][0], np.float32(np.inf))
        f["tokens"][0] = row
    after = pinned.digest(path)
    assert {k for k in after if after[k] != got["serial"][k]} == {"tokens"}

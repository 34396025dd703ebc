"""Every table and attribute a reader trusts is checked (issue 49): each edit below damages one
of them in a detectable way (wrong length, dtype or shape, out of range, not monotonic, missing)
on a copy of a real run's trace, and every front end says so on one line: diff, bisect,
report --html and replay exit 2 with the trace named as damaged, browse's data layer and the
pytest plugin's assertion raise TraceError. test_every_trusted_field_has_an_edit fails when a
new attribute, /meta key, request column, vocab dataset or table appears without one.

tests/trace/test_damaged.py holds the older matrix of table edits (damage.py); this one adds the
header: attributes, /meta, /status, /commit, /requests, /vocab (vocab_offsets: the text of tokens).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from divergence.cli.main import main
from divergence.errors import TraceError
from divergence.trace import schema as S

from .damage import EDITS as TABLE_EDITS


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trusted") / "run"
    p = subprocess.run([sys.executable, "-m", "divergence", "run", "--out", str(d), "--max-tokens", "6"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode in (0, 1), p.stderr
    return d


# -- edits, each of one field (an h5py.File opened r+) ----------------------------------------

def _attr(key, value):
    return lambda f: f.attrs.__setitem__(key, value)


def _del_attr(key):
    return lambda f: f.attrs.__delitem__(key)


def _names(*names):
    return np.array(names, dtype=h5py.string_dtype())


def _settings(**kw):
    def edit(f):
        f[S.META].attrs["settings"] = json.dumps({**json.loads(f[S.META].attrs["settings"]), **kw})
    return edit


def _dataset(group, name, fn):
    """group/name replaced by fn(its data), or deleted where fn gives None."""
    def edit(f):
        g = f[group] if group else f
        data = fn(g[name][()])
        del g[name]
        if data is not None:
            g.create_dataset(name, data=data)
    return edit


def _vocab_offsets(fn):
    return _dataset(S.VOCAB, "offsets", fn)


def _one_more(d):
    return np.where(np.arange(len(d)) == len(d) // 2, d + 1, d)


# field -> {edit name: edit}; field: ("attr", key) | ("meta", key) | ("requests", column) | ("vocab", name)
# | ("dataset", name)
EDITS = {
    ("attr", "format"): {"format_other": _attr("format", "something-else")},
    ("attr", "schema_version"): {"schema_text": _attr("schema_version", "two"),
                                 "schema_newer": _attr("schema_version", 99)},
    ("attr", "models"): {"models_renamed": _attr("models", _names("draft", "target"))},
    ("attr", "phases"): {"phases_number": _attr("phases", 7)},
    ("attr", "kernels"): {"kernels_short": _attr("kernels", _names("native"))},
    ("attr", "ops"): {"ops_twice": _attr("ops", _names("q_proj", "q_proj"))},
    ("attr", "kinds"): {"kinds_renamed": _attr("kinds", _names("a", "b", "c", "d"))},
    ("attr", "draw_purposes"): {"draw_purposes_2d": _attr("draw_purposes", np.array([["sample"]], "S8"))},
    ("attr", "tp_backends"): {"tp_backends_numbers": _attr("tp_backends", np.arange(3))},
    ("attr", "top_k"): {"top_k_zero": _attr("top_k", 0), "top_k_text": _attr("top_k", "eight"),
                        "top_k_narrower": _attr("top_k", 5)},
    ("attr", "widths"): {"widths_not_json": _attr("widths", "{top_k: 8"),
                         "widths_other": _attr("widths", '{"top_k": 3}')},
    ("attr", "kv_hashes"): {"kv_hashes_text": _attr("kv_hashes", "yes")},
    ("attr", "kv_hash"): {"kv_hash_number": _attr("kv_hash", 64)},
    ("attr", "schedule"): {"schedule_number": _attr("schedule", 1)},
    ("attr", "policy"): {"policy_list": _attr("policy", np.arange(2))},
    ("attr", "created"): {"created_number": _attr("created", 2026)},
    ("attr", "commit_tables"): {"commit_tables_missing": _del_attr("commit_tables"),
                                "commit_tables_unknown": _attr("commit_tables", _names(*S.TABLES, "extra"))},
    ("meta", "settings"): {"settings_list": lambda f: f[S.META].attrs.__setitem__("settings", "[]"),
                           "settings_top_k_text": _settings(top_k="8"),
                           "settings_tp_text": _settings(tp="2"),
                           "settings_spec_k_negative": _settings(spec_k=-1)},
    ("meta", "model"): {"model_text": lambda f: f[S.META].attrs.__setitem__("model", '"llama"')},
    ("meta", "draft"): {"draft_list": lambda f: f[S.META].attrs.__setitem__("draft", "[1]")},
    ("meta", "environment"): {"environment_missing": lambda f: f[S.META].attrs.__delitem__("environment")},
    ("dataset", S.STATUS): {"status_empty": _dataset("", S.STATUS, lambda d: d[:0]),
                            "status_two": _dataset("", S.STATUS, lambda d: d + 2)},
    ("dataset", S.COMMIT): {"commit_float": _dataset("", S.COMMIT, lambda d: d.astype(np.float64)),
                            "commit_rows_cut": _dataset("", S.COMMIT, lambda d: d[:4]),
                            "commit_slot": _dataset("", S.COMMIT, lambda d: np.where(np.arange(3) == 2, 7, d))},
    ("requests", "id"): {"ids_twice": _dataset(S.REQUESTS, "id", lambda d: np.array([d[0]] * len(d), d.dtype)),
                         "ids_numbers": _dataset(S.REQUESTS, "id", lambda d: np.arange(len(d)))},
    ("requests", "prompt_offsets"): {"prompt_offsets_back": _dataset(S.REQUESTS, "prompt_offsets", lambda d: d[::-1])},
    ("requests", "prompt_tokens"): {"prompt_tokens_negative": _dataset(S.REQUESTS, "prompt_tokens", lambda d: -d - 1)},
    ("requests", "arrival"): {"arrival_negative": _dataset(S.REQUESTS, "arrival", lambda d: d - 5)},
    ("requests", "max_tokens"): {"max_tokens_short": _dataset(S.REQUESTS, "max_tokens", lambda d: d[:-1])},
    ("requests", "temperature"): {"temperature_nan": _dataset(S.REQUESTS, "temperature", lambda d: d * np.nan)},
    ("requests", "top_p"): {"top_p_zero": _dataset(S.REQUESTS, "top_p", lambda d: d * 0)},
    ("requests", "seed"): {"seed_float": _dataset(S.REQUESTS, "seed", lambda d: d.astype(np.float64))},
    ("vocab", "offsets"): {"offsets_missing": _vocab_offsets(lambda d: None),
                           "offsets_reversed": _vocab_offsets(lambda d: d[::-1]),
                           "offsets_past_the_bytes": _vocab_offsets(lambda d: d + 1),
                           "offsets_short": _vocab_offsets(lambda d: d[:-1]),
                           "offsets_float": _vocab_offsets(lambda d: d.astype(np.float64)),
                           "offsets_2d": _vocab_offsets(lambda d: d[:-1].reshape(-1, 2)),
                           "offsets_one_moved": _vocab_offsets(_one_more)},
    ("vocab", "bytes"): {"bytes_text": _dataset(S.VOCAB, "bytes", lambda d: np.array([b"x"] * len(d))),
                         "bytes_one_changed": _dataset(S.VOCAB, "bytes", _one_more)},
}
# tables: tests/trace/damage.py's edits, and these (a range, a step, an order)
TABLE_ONLY = {
    "steps": lambda f: _set(f, "steps", "index", 3, 2),
    "slices": lambda f: _set(f, "slices", "step", 4, 10**6),
    "slice_tokens": lambda f: _set(f, "slice_tokens", "value", 2, -1),
    "slice_logit_rows": lambda f: _set(f, "slice_logit_rows", "value", 2, -1),
    "kernels": lambda f: _set(f, "kernels", "layer", 2, -1),
    "kv_writes": lambda f: _set(f, "kv_writes", "count", 2, -1),
    "kv_hashes": lambda f: _cut(f, "kv_hashes"),
    "tokens": lambda f: _set(f, "tokens", "position", 2, -1),
    "request_events": lambda f: _set(f, "request_events", "step", 1, -3),
}
# fields no reader trusts (they describe; nothing is read from them), and tables this run leaves empty
NOT_TRUSTED = {("attr", "tables"): "column descriptions for people reading the file"}
EMPTY_HERE = {"draws": "greedy", "routing": "no MoE", "routing_choices": "no MoE", "allreduce": "one device",
              "live_requests": "not a server's", "live_prompt_tokens": "not a server's"}


def _set(f, name, col, row, value):
    rec = f[name][()]
    rec[col][row] = value
    f[name][...] = rec


def _cut(f, name):
    """Half of a table's rows gone, its commit record still naming them all."""
    rec = f[name][()]
    del f[name]
    f.create_dataset(name, data=rec[: len(rec) // 2], maxshape=(None,), chunks=True)


CASES = {name: fn for edits in EDITS.values() for name, fn in edits.items()}
CASES.update({f"table_{name}": fn for name, fn in TABLE_ONLY.items()})


def _fields(path) -> set:
    with h5py.File(path, "r") as f:
        out = {("attr", k) for k in f.attrs} | {("meta", k) for k in f[S.META].attrs}
        out |= {("requests", k) for k in f[S.REQUESTS]} | {("vocab", k) for k in f[S.VOCAB]}
        out |= {("dataset", k) for k in (S.STATUS, S.COMMIT)}
    return out


def test_every_trusted_field_has_an_edit(run_dir):
    fields = _fields(run_dir / "concurrent.h5")
    missing = fields - set(EDITS) - set(NOT_TRUSTED)
    assert not missing, f"fields no edit damages: {sorted(missing)}"
    tables_edited = {t for t in TABLE_ONLY} | {"tokens", "steps", "kernels", "kv_writes"}  # damage.py's
    assert set(S.TABLES) == tables_edited | set(EMPTY_HERE), set(S.TABLES) ^ (tables_edited | set(EMPTY_HERE))
    assert TABLE_EDITS, "tests/trace/damage.py's table edits run in test_damaged.py"


@pytest.mark.parametrize("edit", list(CASES))
def test_every_front_end_refuses_the_damaged_field(run_dir, tmp_path, capsys, edit):
    a = run_dir / "serial.h5"
    b = tmp_path / "damaged.h5"
    shutil.copyfile(run_dir / "concurrent.h5", b)
    with h5py.File(b, "r+") as f:
        CASES[edit](f)
    for cmd in ("diff", "bisect", "report", "replay"):
        argv = {"diff": ["diff", a, b], "bisect": ["bisect", a, b], "replay": ["replay", b],
                "report": ["report", a, b, "--html", tmp_path / "r.html"]}[cmd]
        capsys.readouterr()
        assert main([str(x) for x in argv]) == 2, cmd
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"divergence {cmd}: error: ") and str(b) in err[0], (cmd, err)
        assert "Traceback" not in err[0]
    assert not (tmp_path / "r.html").exists()
    from divergence.testing.assertions import assert_traces_equal
    from divergence.tui.data.session import BrowseData

    for front in (lambda: BrowseData.open(a, b).analyse(), lambda: assert_traces_equal(a, b)):
        with pytest.raises(TraceError) as e:
            front()
        assert "\n" not in str(e.value) and str(b) in str(e.value)


def test_the_undamaged_trace_reads_and_a_v1_trace_too(run_dir):
    """The checks pass on the traces the edits start from, and on schema 1's (no digest there)."""
    from pathlib import Path

    from divergence import Trace

    for p in (run_dir / "concurrent.h5", Path(__file__).parents[2] / "traces" / "v1" / "concurrent.h5"):
        with Trace.open(p) as t:
            t.check()
            assert t.vocab is not None and len(t.vocab) == 1024 and t.completed

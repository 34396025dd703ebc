"""Malformed records: one line naming the file and line, exit 2, nothing written
(an earlier trace at --out stays as it was)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from divergence.cli.main import main
from divergence.cli.paths import remember_outputs
from divergence.errors import RecordError
from divergence.record import Recorder

from .test_recorder import script, write_jsonl


def edit(d, name, line, fn):
    """Replace line `line` (1-based) of d/name.jsonl by fn(record) (a dict or a raw string)."""
    p = d / f"{name}.jsonl"
    lines = p.read_text().splitlines()
    new = fn(json.loads(lines[line - 1]))
    lines[line - 1] = new if isinstance(new, str) else json.dumps(new)
    p.write_text("\n".join(lines) + "\n")


def drop(key):
    return lambda r: {k: v for k, v in r.items() if k != key}


def put(key, value):
    return lambda r: {**r, key: value}


CASES = [
    # missing fields
    ("tokens", 2, drop("position"), "tokens.jsonl:2: token: missing field 'position'"),
    ("kv_writes", 1, drop("k_hashes"), "kv_writes.jsonl:1: kv_write: missing field 'k_hashes'"),
    ("steps", 1, lambda r: {**r, "slices": [drop("count")(r["slices"][0])]}, "steps.jsonl:1: slice: missing field 'count'"),
    ("kernels", 3, drop("step"), "kernels.jsonl:3: kernel: missing field 'step'"),
    ("run", 1, drop("engine"), "run.jsonl:1: run: missing field 'engine'"),
    # wrong types
    ("steps", 2, put("index", "2"), "steps.jsonl:2: step.index: expected an integer, got '2'"),
    ("tokens", 1, put("token", 4.0), "tokens.jsonl:1: token.token: expected an integer, got 4.0"),
    ("tokens", 1, put("topk_logits", ["a", 1, 2, 3]), "tokens.jsonl:1: token.topk_logits[0]: expected a number"),
    ("kernels", 1, put("rows", True), "kernels.jsonl:1: kernel.rows: expected an integer, got True"),
    ("requests", 1, put("prompt", "3 1 4"), "requests.jsonl:1: request.prompt: expected a list of integers"),
    ("steps", 1, lambda r: {**r, "slices": [{**r["slices"][0], "phase": "warmup"}]},
     "steps.jsonl:1: slice.phase: 'warmup' is not one of prefill, decode, verify, draft"),
    # steps out of order
    ("steps", 3, put("index", 1), "steps.jsonl:3: step.index: 1 does not follow step 2 ("),
    ("steps", 2, put("index", 0), "steps.jsonl:2: step.index: 0 does not follow step 0 ("),
    # hashes of the wrong width
    ("kv_writes", 2, lambda r: {**r, "k_hashes": [r["k_hashes"][0][:15]] + r["k_hashes"][1:]},
     "kv_writes.jsonl:2: kv_write.k_hashes[0]: '"),
    ("kv_writes", 2, lambda r: {**r, "v_hashes": [r["v_hashes"][0] + "00"] + r["v_hashes"][1:]},
     "is not a 64-bit hash: expected 16 hex digits"),
    ("kv_writes", 2, lambda r: {**r, "v_hashes": [12345] + r["v_hashes"][1:]},
     "kv_writes.jsonl:2: kv_write.v_hashes[0]: expected a 64-bit hash as 16 hex digits, got 12345"),
    ("kv_writes", 2, lambda r: {**r, "v_hashes": r["v_hashes"][1:]}, "k_hashes but"),
    # unknown requests
    ("tokens", 4, put("request", "r9"), "tokens.jsonl:4: token: unknown request 'r9'"),
    ("kv_writes", 3, put("request", "r9"), "kv_writes.jsonl:3: kv_write: unknown request 'r9'"),
    ("steps", 1, lambda r: {**r, "slices": [{**r["slices"][0], "request": "r9"}]}, "steps.jsonl:1: step: unknown request 'r9'"),
    ("finishes", 1, put("request", "r9"), "finishes.jsonl:1: finish: unknown request 'r9'"),
    # contract breaks across records
    ("tokens", 2, put("position", 9), "tokens.jsonl:2: token: 'r1' position 9, but its next token is at 6"),
    ("tokens", 1, put("step", 2), "tokens.jsonl:1: token: step 2 has no row of 'r1' at position 4"),
    ("kernels", 1, put("step", 7), "kernels.jsonl:1: kernel.step: step 7 has no step record"),
    ("tokens", 1, lambda r: {**r, "topk_logits": r["topk_logits"][::-1]}, "tokens.jsonl:1: token: topk_logits are not best first"),
    ("tokens", 1, lambda r: {**r, "topk_ids": r["topk_ids"][:3]}, "tokens.jsonl:1: token: 3 topk_ids but 4 topk_logits"),
    ("tokens", 1, put("logit", 1.5), "tokens.jsonl:1: token: logit 1.5 differs from the top-k's logit"),
    ("tokens", 1, put("topk_logit", [1.0]), "tokens.jsonl:1: token: unknown field 'topk_logit'"),
    ("tokens", 1, put("kind", "kernel"), "tokens.jsonl:1: a 'kernel' record in tokens.jsonl, which holds 'token'"),
    # not JSON
    ("tokens", 3, lambda r: '{"step": 2, "request": "r1",', "tokens.jsonl:3: not valid JSON"),
    ("tokens", 3, lambda r: "[1, 2]", "tokens.jsonl:3: expected a JSON object, got list"),
]


@pytest.mark.parametrize("name, line, fn, needle", CASES, ids=[c[3][:50] for c in CASES])
def test_bad_record_one_line_exit_2_nothing_written(tmp_path, capsys, name, line, fn, needle):
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)))
    out = tmp_path / "t.h5"
    out.write_bytes(b"an earlier trace")
    remember_outputs([out], command="import")  # an earlier import's (else refused as another's file)
    edit(d, name, line, fn)
    capsys.readouterr()
    assert main(["import", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert err[0].startswith("divergence import: error: ")
    assert out.read_bytes() == b"an earlier trace" and not list(tmp_path.glob("*.partial"))


def test_directory_level_errors(tmp_path, capsys):
    def err_of(src):
        capsys.readouterr()
        assert main(["import", str(src), "--out", str(tmp_path / "t.h5")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "no such directory" in err_of(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "holds no .jsonl files" in err_of(tmp_path / "empty")
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)))
    (d / "run.jsonl").unlink()
    assert "no run record" in err_of(d)
    (d / "extra.jsonl").write_text('{"step": 0}\n')
    assert "extra.jsonl:1: no 'kind' field" in err_of(d)
    (d / "extra.jsonl").write_text('{"kind": "tok"}\n')
    assert "extra.jsonl:1: unknown kind 'tok'" in err_of(d)
    (d / "extra.jsonl").unlink()
    (d / "run.jsonl").write_text('{"engine": "x", "schedule": "s"}\n{"engine": "x", "schedule": "s"}\n')
    assert "run.jsonl:2: a second run record" in err_of(d)
    (d / "run.jsonl").write_text('{"engine": "x", "schedule": "s", "contract": 99}\n')
    assert "contract 99 is newer" in err_of(d)
    (d / "run.jsonl").write_text('{"engine": "x", "schedule": "s", "kv_hash": null}\n{"kind": "end", "records": 1}\n')
    assert "kv_write records need the hash named" in err_of(d)
    assert not (tmp_path / "t.h5").exists()


def test_the_api_raises_at_the_call_that_breaks_the_contract(tmp_path):
    rec = Recorder(tmp_path / "t.h5", engine="x", schedule="serial", requests=[{"id": "r1", "prompt": [1, 2]}])
    with pytest.raises(RecordError, match="no step yet"):
        rec.kernel("q", "mv", layer=0, rows=1)
    rec.step([("r1", "prefill", 0, 2)])
    with pytest.raises(RecordError, match="go past the prompt of 'r1'"):
        rec.step([("r1", "prefill", 0, 3)])
    with pytest.raises(RecordError, match="rows of 'r1' and 'r1' overlap"):
        rec.step([("r1", "decode", 2, 1, 0), ("r1", "decode", 3, 1, 0)])
    with pytest.raises(RecordError, match="not a float32 value"):
        rec.token("r1", position=2, token=1, topk_ids=[1], topk_logits=np.array([0.1], np.float64))
    with pytest.raises(RecordError, match="uint64"):
        rec.kv_write("r1", layer=0, start=0, k_hashes=np.zeros(2, np.float32), v_hashes=np.zeros(2, np.uint64))
    rec.token("r1", position=2, token=1, topk_ids=[1], topk_logits=np.array([0.1], np.float32))
    rec.close()
    with pytest.raises(RecordError, match="closed"):
        rec.step([("r1", "decode", 2, 1)])

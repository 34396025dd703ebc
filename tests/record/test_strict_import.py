"""Strict import and record (issue 28): inputs that `divergence import` and
`divergence.record` used to accept silently are refused with one line naming the
file:line and the field, exit 2 from the CLI, a RecordError from the API, and no
file written.

The run (tests/record/test_recorder.py's script), line by line:
  steps.jsonl      1: step 0 r1 prefill 0..4 | 2: step 2 r1 decode 5, r2 prefill 0..2 | 3: step 4 r1 decode 6, r2 decode 3
  kv_writes.jsonl  1-2: step 0 r1 (layers 0, 1) | 3-6: step 2 r1, r1, r2, r2 | 7-10: step 4 r1, r1, r2, r2
  tokens.jsonl     1: r1@5 (step 0) | 2: r1@6, 3: r2@3 (step 2) | 4: r1@7, 5: r2@4 (step 4)
  finishes.jsonl   1: step 4 r2 length (r2's max_tokens is 2; r1 has none)
and each file's last line is its end record.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from divergence import Trace
from divergence.cli.main import main
from divergence.cli.paths import remember_outputs
from divergence.errors import RecordError
from divergence.record import Recorder
from divergence.record.jsonl import import_records

from .test_bad_records import edit
from .test_recorder import REQS, same_trace, script, write_jsonl


def lines_of(d, name):
    return (d / f"{name}.jsonl").read_text().splitlines()


def rewrite(d, name, fn, *, end=True):
    """Replace d/name.jsonl's records by fn(records) and write a matching end record."""
    recs = [json.loads(x) for x in lines_of(d, name)]
    if recs and recs[-1].get("kind") == "end":
        recs = recs[:-1]
    recs = fn(recs)
    tail = [{"kind": "end", "records": len(recs)}] if end else []
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs + tail))


def cut(d, name, keep):
    """d/name.jsonl cut short at a line boundary: only its first `keep` lines are left."""
    text = lines_of(d, name)[:keep]
    (d / f"{name}.jsonl").write_text("".join(x + "\n" for x in text))


def refused(tmp_path, capsys, d):
    """Import d through the CLI: exit 2, one line, the earlier trace at --out untouched, no
    partial file; the API raises RecordError with the same message. Returns the message."""
    out = tmp_path / "t.h5"
    out.write_bytes(b"an earlier trace")
    remember_outputs([out], command="import")  # an earlier import's (else refused as another's file)
    capsys.readouterr()
    assert main(["import", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("divergence import: error: "), err
    assert out.read_bytes() == b"an earlier trace"
    with pytest.raises(RecordError) as e:
        import_records(d, tmp_path / "api.h5")
    assert str(e.value) == err[0].removeprefix("divergence import: error: ")
    assert not (tmp_path / "api.h5").exists() and not list(tmp_path.glob("*.partial"))
    return str(e.value).removeprefix(str(d) + "/")


def with_slice(line, extra):
    return lambda r: {**r, "slices": r["slices"] + [extra]} if r["index"] == 2 else r


# (what is broken, how, the start of the one line)
CASES = [
    # a kv_write for a request that has no slice in its step
    ("kv_write of a request not in its step", lambda d: edit(d, "kv_writes", 1, lambda r: {**r, "request": "r2"}),
     "kv_writes.jsonl:1: kv_write.request: step 0 has no slice of 'r2' (its slices: r1 prefill 0..4)"),
    # a kv_write at positions outside its slice
    ("kv_write past its slice", lambda d: edit(d, "kv_writes", 3, lambda r: {**r, "start": 6}),
     "kv_writes.jsonl:3: kv_write.start: positions 6..6 of 'r1' are not inside one slice of step 2 "
     "(r1 decode 5..5)"),
    ("kv_write straddling its slice's start", lambda d: edit(d, "kv_writes", 2, lambda r: {**r, "start": 1}),
     "kv_writes.jsonl:2: kv_write.start: positions 1..5 of 'r1' are not inside one slice of step 0"),
    ("kv_write longer than its slice",
     lambda d: edit(d, "kv_writes", 5, lambda r: {**r, "k_hashes": r["k_hashes"] * 2, "v_hashes": r["v_hashes"] * 2}),
     "kv_writes.jsonl:5: kv_write.start: positions 0..5 of 'r2' are not inside one slice of step 2 "
     "(r2 prefill 0..2)"),
    # a file cut short at a line boundary
    ("tokens.jsonl cut after 4 lines", lambda d: cut(d, "tokens", 4),
     "tokens.jsonl:5: end: missing: the file ends after 4 records without its end record "
     '{"kind": "end", "records": 4}: cut short?'),
    ("a token lost, the end record kept", lambda d: rewrite(d, "tokens", lambda rs: rs[:-1] + [{"kind": "end", "records": 5}], end=False),
     "tokens.jsonl:5: end.records: 5, but the file holds 4 records before it: lines lost?"),
    ("an empty tokens.jsonl", lambda d: (d / "tokens.jsonl").write_text(""),
     'tokens.jsonl:1: end: missing: the file is empty without its end record {"kind": "end", "records": 0}'),
    ("steps.jsonl cut after its first step", lambda d: cut(d, "steps", 1),
     "steps.jsonl:2: end: missing: the file ends after 1 record without"),
    ("a record after the end record", lambda d: (d / "finishes.jsonl").write_text(
        (d / "finishes.jsonl").read_text() + '{"step": 4, "request": "r1", "reason": "stop"}\n'),
     "finishes.jsonl:3: a record after the end record ("),
    ("an end record without its count", lambda d: edit(d, "kernels", 13, lambda r: {"kind": "end"}),
     "kernels.jsonl:13: end: missing field 'records'"),
    ("an end record with a string count", lambda d: edit(d, "kernels", 13, lambda r: {**r, "records": "12"}),
     "kernels.jsonl:13: end.records: expected an integer, got '12'"),
    # the tokens and the finish disagree (the engine lost tokens, or wrote too many)
    ("a length finish one token short", lambda d: rewrite(d, "tokens", lambda rs: rs[:-1]),
     "finishes.jsonl:1: finish.reason: 'length', but 'r2' has 1 token recorded (before this finish), not its "
     "max_tokens 2: tokens missing?"),
    ("a length finish with no tokens", lambda d: rewrite(d, "tokens", lambda rs: []),
     "finishes.jsonl:1: finish.reason: 'length', but 'r2' has 0 tokens recorded"),
    ("a length finish of a request without max_tokens and no tokens",
     lambda d: (rewrite(d, "tokens", lambda rs: [r for r in rs if r["request"] == "r2"]),
                rewrite(d, "finishes", lambda rs: rs + [{"step": 4, "request": "r1", "reason": "length"}])),
     "finishes.jsonl:2: finish.reason: 'length', but 'r1' has no tokens recorded (before this finish): tokens "
     "missing?"),
    ("more tokens than max_tokens", lambda d: edit(d, "requests", 2, lambda r: {**r, "max_tokens": 1}),
     "tokens.jsonl:5: token.position: 4 would be token 2 of 'r2', whose max_tokens is 1"),
    ("a token after the finish", lambda d: edit(d, "finishes", 1, lambda r: {**r, "step": 2, "reason": "stop"}),
     "tokens.jsonl:5: token.request: 'r2' already finished (step 2): no tokens after its finish record"),
    ("two finishes", lambda d: rewrite(d, "finishes", lambda rs: rs + [{"step": 4, "request": "r2", "reason": "stop"}]),
     "finishes.jsonl:2: finish.request: 'r2' already finished (step 4)"),
    ("more top-k entries than the run's top_k",
     lambda d: edit(d, "tokens", 1, lambda r: {**r, "topk_ids": r["topk_ids"] + [max(r["topk_ids"]) + 1],
                                               "topk_logits": r["topk_logits"] + [-3.4028234663852886e38]}),
     "tokens.jsonl:1: token.topk_ids: 5 top-k entries but the run's top_k is 4"),
    # overlapping slices of one request in one step, and slices that leave the step's rows
    ("one request's slices overlap",
     lambda d: rewrite(d, "steps", lambda rs: [with_slice(2, {"request": "r1", "phase": "verify", "start": 4,
                                                              "count": 2})(r) for r in rs]),
     "steps.jsonl:2: step.slices[2].start: positions 4..5 of 'r1' overlap those of slices[0] (5..5)"),
    ("one position twice, in slices of other phases",
     lambda d: rewrite(d, "steps", lambda rs: [with_slice(2, {"request": "r2", "phase": "draft", "start": 2,
                                                              "count": 1})(r) for r in rs]),
     "steps.jsonl:2: step.slices[2].start: positions 2..2 of 'r2' overlap those of slices[1] (0..2)"),
    ("a slice past the step's rows",
     lambda d: edit(d, "steps", 2, lambda r: {**r, "slices": [r["slices"][0], {**r["slices"][1], "row_offset": 2}]}),
     "steps.jsonl:2: step.slices[1].row_offset: rows 2..4 go past the step's 4 rows (the slices' counts): the "
     "slices must fill rows 0..3 without gaps"),
    # a step out of order is named at its own line (it used to be blamed on a token)
    ("a step out of order", lambda d: edit(d, "steps", 2, lambda r: {**r, "index": 4}),
     "steps.jsonl:3: step.index: 4 does not follow step 4 ("),
    ("a step whose index a later step has", lambda d: edit(d, "steps", 1, lambda r: {**r, "index": 2}),
     "steps.jsonl:2: step.index: 2 does not follow step 2 ("),
]


@pytest.mark.parametrize("what, fn, needle", CASES, ids=[c[0] for c in CASES])
def test_refused_with_one_line_naming_file_line_and_field(tmp_path, capsys, what, fn, needle):
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)))
    fn(d)
    msg = refused(tmp_path, capsys, d)
    assert msg.startswith(needle), msg


def test_a_step_out_of_order_names_both_step_lines_not_a_token(tmp_path, capsys):
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)))
    edit(d, "steps", 2, lambda r: {**r, "index": 4})
    msg = refused(tmp_path, capsys, d)
    assert msg == f"steps.jsonl:3: step.index: 4 does not follow step 4 ({d}/steps.jsonl:2): steps must be " \
                  f"strictly increasing", msg


def test_one_file_errors_name_the_line_of_the_record(tmp_path, capsys):
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)), one_file=True)
    text = lines_of(d, "events")
    steps = [n for n, x in enumerate(text, 1) if json.loads(x).get("kind") == "step"]
    second = json.loads(text[steps[1] - 1])
    text[steps[1] - 1] = json.dumps({**second, "index": 4})  # steps 0, 4, 4: the third is out of order
    (d / "events.jsonl").write_text("\n".join(text) + "\n")
    msg = refused(tmp_path, capsys, d)
    assert msg.startswith(f"events.jsonl:{steps[2]}: step.index: 4 does not follow step 4 "
                          f"({d}/events.jsonl:{steps[1]})"), msg
    # the same file, cut short at a line boundary: the missing end record is named
    d2 = write_jsonl(tmp_path / "in2", script(np.random.default_rng(0)), one_file=True)
    cut(d2, "events", steps[2])
    msg = refused(tmp_path, capsys, d2)
    assert msg.startswith(f"events.jsonl:{steps[2] + 1}: end: missing: the file ends after {steps[2]} records"), msg


def test_kv_hash_missing_names_the_run_record(tmp_path, capsys):
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)))
    edit(d, "run", 1, lambda r: {**r, "kv_hash": None})
    msg = refused(tmp_path, capsys, d)
    assert msg == f"run.jsonl:1: run.kv_hash: kv_write records need the hash named (kv_hash, e.g. xxh3_64): " \
                  f"{d}/kv_writes.jsonl:1 is one", msg


# -- what still imports -------------------------------------------------------------------
def test_a_contract_1_run_without_end_records_imports_to_the_same_trace(tmp_path):
    records = script(np.random.default_rng(1))
    new = write_jsonl(tmp_path / "v2", records)
    old = write_jsonl(tmp_path / "v1", records, end=False)
    assert all(json.loads(lines_of(new, p.stem)[-1])["kind"] == "end" for p in new.glob("*.jsonl"))
    assert not any("end" in p.read_text() for p in old.glob("*.jsonl") if p.stem != "run")
    assert import_records(new, tmp_path / "v2.h5") == import_records(old, tmp_path / "v1.h5")
    same_trace(tmp_path / "v2.h5", tmp_path / "v1.h5")


def test_a_contract_1_run_still_checks_its_records(tmp_path, capsys):
    """Without end records a cut file cannot be seen as such, but its tokens then disagree
    with the finish; an end record that is there is still checked."""
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)), end=False)
    cut(d, "tokens", 4)  # r2's second token lost
    msg = refused(tmp_path, capsys, d)
    assert msg.startswith("finishes.jsonl:1: finish.reason: 'length', but 'r2' has 1 token recorded"), msg
    d2 = write_jsonl(tmp_path / "in2", script(np.random.default_rng(0)), end=False)
    rewrite(d2, "kernels", lambda rs: rs)  # writes an end record ...
    edit(d2, "kernels", 13, lambda r: {**r, "records": 11})  # ... with the wrong count
    msg = refused(tmp_path, capsys, d2)
    assert msg.startswith("kernels.jsonl:13: end.records: 11, but the file holds 12 records"), msg


def test_without_a_contract_1_declaration_files_need_their_end_records(tmp_path, capsys):
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)), end=False)
    edit(d, "run", 1, lambda r: {k: v for k, v in r.items() if k != "contract"})
    msg = refused(tmp_path, capsys, d)
    assert msg.startswith("finishes.jsonl:2: end: missing: the file ends after 1 record without"), msg  # files in name order
    assert '"contract": 1' in msg


def test_blank_lines_are_not_records(tmp_path):
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)))
    text = lines_of(d, "tokens")
    (d / "tokens.jsonl").write_text("\n".join(text[:2] + ["", "   "] + text[2:]) + "\n\n")
    assert import_records(d, tmp_path / "t.h5")["tokens"] == 5


def test_a_kv_write_may_cover_part_of_its_slice(tmp_path):
    """Inside its slice is enough: an engine may write a slice's K/V in pieces."""
    path = tmp_path / "t.h5"
    h = np.arange(1, 6, dtype=np.uint64)
    with Recorder(path, engine="x", schedule="serial", requests=[{"id": "r1", "prompt": [1, 2, 3, 4, 5]}]) as rec:
        rec.step([("r1", "prefill", 0, 5)])
        rec.kv_write("r1", layer=0, start=0, k_hashes=h[:2], v_hashes=h[:2])
        rec.kv_write("r1", layer=0, start=2, k_hashes=h[2:], v_hashes=h[2:])
    with Trace.open(path) as t:
        assert t.live_kv("r1")["k_hash"].tolist() == [1, 2, 3, 4, 5]


# -- the API: RecordError at the call, and nothing written --------------------------------
def _two(rec):
    rec.step([("r1", "prefill", 0, 3)])
    rec.token("r1", position=3, token=1, topk_ids=[1], topk_logits=np.array([0.5], np.float32))


H1 = np.array([7], np.uint64)
TOK = dict(topk_ids=[1], topk_logits=np.array([0.5], np.float32))
API_CASES = [
    ("kv_write of a request not in its step",
     lambda rec: rec.kv_write("r2", layer=0, start=0, k_hashes=H1, v_hashes=H1),
     "kv_write.request: step 0 has no slice of 'r2' (its slices: r1 prefill 0..2)"),
    ("kv_write outside its slice",
     lambda rec: rec.kv_write("r1", layer=0, start=3, k_hashes=H1, v_hashes=H1),
     "kv_write.start: positions 3..3 of 'r1' are not inside one slice of step 0 (r1 prefill 0..2)"),
    ("a length finish with tokens missing", lambda rec: rec.finish("r1", reason="length"),
     "finish.reason: 'length', but 'r1' has 1 token recorded (before this finish), not its max_tokens 2"),
    ("a token past max_tokens",
     lambda rec: (rec.step([("r1", "decode", 3, 1)]), rec.token("r1", position=4, token=1, **TOK),
                  rec.step([("r1", "decode", 4, 1)]), rec.token("r1", position=5, token=1, **TOK)),
     "token.position: 5 would be token 3 of 'r1', whose max_tokens is 2"),
    ("a token after the finish",
     lambda rec: (rec.finish("r1", reason="stop"), rec.step([("r1", "decode", 3, 1)]),
                  rec.token("r1", position=4, token=1, **TOK)),
     "token.request: 'r1' already finished (step 0)"),
    ("overlapping slices of one request", lambda rec: rec.step([("r1", "decode", 3, 1), ("r1", "verify", 3, 2)]),
     "step.slices[1].start: positions 3..4 of 'r1' overlap those of slices[0] (3..3)"),
    ("a slice past the step's rows", lambda rec: rec.step([("r1", "decode", 3, 1, 1)]),
     "step.slices[0].row_offset: rows 1..1 go past the step's 1 rows"),
]


@pytest.mark.parametrize("what, fn, needle", API_CASES, ids=[c[0] for c in API_CASES])
def test_the_api_refuses_at_the_call_and_writes_nothing(tmp_path, what, fn, needle):
    path = tmp_path / "t.h5"
    path.write_bytes(b"an earlier trace")
    with pytest.raises(RecordError) as e:
        with Recorder(path, engine="x", schedule="serial",
                      requests=[{"id": "r1", "prompt": [1, 2, 3], "max_tokens": 2}, {"id": "r2", "prompt": [4]}]) as rec:
            _two(rec)
            fn(rec)
    assert str(e.value).startswith(needle), str(e.value)
    assert "\n" not in str(e.value)
    assert path.read_bytes() == b"an earlier trace" and not list(tmp_path.glob("*.partial"))


def test_the_api_still_writes_an_incomplete_trace_when_the_engine_fails(tmp_path):
    """Only a refused record writes nothing: another exception keeps what was recorded."""
    path = tmp_path / "t.h5"
    with pytest.raises(ZeroDivisionError):
        with Recorder(path, engine="x", schedule="serial", requests=REQS[:1]) as rec:
            rec.step([("r1", "prefill", 0, 5)])
            1 / 0
    with Trace.open(path) as t:
        assert not t.completed and t.num_steps == 1

"""divergence.record: what a foreign engine records is what the trace holds, bit for bit,
and JSON Lines import gives the same trace as the Python API."""
from __future__ import annotations

import json

import numpy as np
import pytest

from divergence import Trace
from divergence.errors import RecordError
from divergence.record import Recorder, hash_kv
from divergence.record.jsonl import import_records

REQS = [{"id": "r1", "prompt": [3, 1, 4, 1, 5]}, {"id": "r2", "prompt": [9, 2, 6], "max_tokens": 2, "arrival": 1}]


def odd_float32(rng, n):
    """float32 values with awkward bit patterns (subnormals, -0.0, huge), sorted best first."""
    bits = rng.integers(0, 2**31 - 2**23, size=n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    return np.sort(bits.view(np.float32))[::-1]


def script(rng):
    """One small run as records: (kind, fields) in the order an engine emits them."""
    out = [("step", {"index": 0, "slices": [{"request": "r1", "phase": "prefill", "start": 0, "count": 5}]})]
    steps = [[("r1", "prefill", 0, 5)], [("r1", "decode", 5, 1), ("r2", "prefill", 0, 3)],
             [("r1", "decode", 6, 1), ("r2", "decode", 3, 1)]]
    out = []
    for i, sl in enumerate(steps):
        rows = sum(s[3] for s in sl)
        out.append(("step", {"index": 2 * i, "slices": [dict(zip(("request", "phase", "start", "count"), s))
                                                        for s in sl], "duration": 0.25 * i}))
        for layer in range(2):
            for op in ("attn.qkv", "mlp.up"):
                out.append(("kernel", {"step": 2 * i, "layer": layer, "op": op, "rows": rows,
                                       "kernel": "mv" if rows == 1 else "mm_t/4", "n": 8, "k": 16}))
        for rid, _, start, count in sl:
            for layer in range(2):
                kv = rng.standard_normal((count, 2, 4)).astype(np.float16)
                out.append(("kv_write", {"step": 2 * i, "request": rid, "layer": layer, "start": start,
                                         "k_hashes": hash_kv(kv), "v_hashes": hash_kv(-kv)}))
        for rid, _, start, count in sl:
            logits = odd_float32(rng, 4)
            ids = rng.permutation(50)[:4]
            out.append(("token", {"step": 2 * i, "request": rid, "position": start + count, "token": int(ids[0]),
                                  "topk_ids": ids, "topk_logits": logits, "logit": logits[0]}))
    out.append(("finish", {"step": 4, "request": "r2", "reason": "length"}))
    return out


def record_api(path, records):
    with Recorder(path, engine="toy-engine 0.1", schedule="concurrent", requests=REQS,
                  model={"name": "toy", "weights_hash": "w1", "dtype": "float16"}, top_k=4) as rec:
        for kind, fields in records:
            rec.add(kind, dict(fields))
    return path


def to_json(v):
    if isinstance(v, np.ndarray) and v.dtype == np.uint64:
        return [f"{int(x):016x}" for x in v]
    if isinstance(v, np.ndarray):
        return [float(x) if v.dtype.kind == "f" else int(x) for x in v]
    if isinstance(v, np.floating):
        return float(v)
    return v


def write_jsonl(d, records, *, one_file=False, end=True):
    """The records as the contract's JSON Lines in directory d; end: each file's last line is
    its end record (contract 2); end=False writes a contract 1 run (no end records)."""
    d.mkdir()
    run = {"engine": "toy-engine 0.1", "schedule": "concurrent", "model": {"name": "toy", "weights_hash": "w1",
           "dtype": "float16"}, "top_k": 4, "kv_hash": "xxh3_64", **({} if end else {"contract": 1})}
    lines = [("run", run)] + [("request", r) for r in REQS] + list(records)
    files = {}
    for kind, fields in lines:
        rec = {k: to_json(v) for k, v in fields.items()}
        if one_file:
            files.setdefault("events", []).append({"kind": kind, **rec})
        else:
            files.setdefault({"kv_write": "kv_writes", "finish": "finishes", "run": "run"}.get(kind, kind + "s"),
                             []).append(rec)
    for name, recs in files.items():
        tail = [{"kind": "end", "records": len(recs)}] if end else []
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs + tail))
    return d


def same_trace(pa, pb):
    with Trace.open(pa) as a, Trace.open(pb) as b:
        assert a.completed and b.completed
        assert list(a.iter_plans()) == list(b.iter_plans())
        assert a.meta["settings"] == b.meta["settings"] and a.meta["model"] == b.meta["model"]
        ka, kb = a.kernels(), b.kernels()
        assert all(np.array_equal(ka[c], kb[c]) for c in ka)
        for rid in ("r1", "r2"):
            ta, tb = a.tokens(rid), b.tokens(rid)
            for x, y in zip(ta, tb):
                assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
            la, lb = a.live_kv(rid), b.live_kv(rid)
            assert all(np.array_equal(la[c], lb[c]) for c in la)
        assert a.finish_step("r2") == b.finish_step("r2") == 4


def test_recorder_round_trip(tmp_path):
    records = script(np.random.default_rng(0))
    path = record_api(tmp_path / "t.h5", records)
    with Trace.open(path) as t:
        assert t.meta["settings"]["engine"] == "toy-engine 0.1" and t.kv_hash == "xxh3_64"
        assert [r.id for r in t.requests] == ["r1", "r2"] and t.requests[0].max_tokens == 3
        p = t.step_plan(2)
        assert [(s.request_id, s.phase, s.start, s.count, s.row_offset) for s in p.slices] == \
               [("r1", "decode", 5, 1, 0), ("r2", "prefill", 0, 3, 1)]
        # input tokens come from the prompt and the tokens generated; logit rows from the tokens
        r1_first = int(t.tokens("r1").tokens[0])
        assert p.slices[0].tokens == (r1_first,) and p.slices[1].tokens == (9, 2, 6)
        assert p.slices[0].logit_rows == (0,) and p.slices[1].logit_rows == (2,)
        k = t.kernels(step=2)
        assert set(k["op"]) == {"attn.qkv", "mlp.up"} and set(k["kernel"]) == {"mm_t/4"}
        toks = [f for kind, f in records if kind == "token" and f["request"] == "r1"]
        got = t.tokens("r1")
        assert np.array_equal(got.topk_logits.view(np.uint32), np.stack([f["topk_logits"] for f in toks]).view(np.uint32))
        kvs = [f for kind, f in records if kind == "kv_write" and f["request"] == "r2" and f["layer"] == 1]
        live = t.live_kv("r2")
        sel = live["layer"] == 1
        assert np.array_equal(live["k_hash"][sel], np.concatenate([f["k_hashes"] for f in kvs]))


@pytest.mark.parametrize("one_file", [False, True])
def test_jsonl_import_gives_the_api_trace(tmp_path, one_file):
    records = script(np.random.default_rng(1))
    api = record_api(tmp_path / "api.h5", records)
    d = write_jsonl(tmp_path / "jsonl", records, one_file=one_file)
    counts = import_records(d, tmp_path / "imported.h5")
    assert counts == {"requests": 2, "steps": 3, "tokens": 5}
    same_trace(api, tmp_path / "imported.h5")


def test_shortest_float32_decimals_round_trip_exactly(tmp_path):
    """Engines in other languages print float32 as its shortest decimal (Rust's f32 Display):
    those parse back to the same bits; a float64 value is refused, not silently rounded."""
    records = script(np.random.default_rng(2))
    d = write_jsonl(tmp_path / "jsonl", records)
    *lines, end = (d / "tokens.jsonl").read_text().splitlines()
    short = []
    for line in lines:
        r = json.loads(line)
        vals = ", ".join(str(np.float32(x)) for x in r.pop("topk_logits"))  # e.g. 25.571232, not 25.57123184...
        short.append(json.dumps(r)[:-1] + f', "topk_logits": [{vals}]}}')
    (d / "tokens.jsonl").write_text("\n".join(short + [end]) + "\n")
    import_records(d, tmp_path / "t.h5")
    with Trace.open(tmp_path / "t.h5") as t:
        toks = [f for kind, f in records if kind == "token" and f["request"] == "r1"]
        assert np.array_equal(t.tokens("r1").topk_logits.view(np.uint32),
                              np.stack([f["topk_logits"] for f in toks]).view(np.uint32))
    r = json.loads(short[0])
    r["topk_logits"][1] = r["topk_logits"][1] * (1 + 1e-12) if r["topk_logits"][1] else 1e-300
    (d / "tokens.jsonl").write_text("\n".join([json.dumps(r)] + short[1:] + [end]) + "\n")
    with pytest.raises(RecordError, match=r"tokens.jsonl:1: .*not a float32 value"):
        import_records(d, tmp_path / "t2.h5")
    assert not (tmp_path / "t2.h5").exists() and not (tmp_path / "t2.h5.partial").exists()


def test_recording_and_importing_load_neither_mlx_nor_the_engine(tmp_path):
    import subprocess
    import sys
    import textwrap

    d = write_jsonl(tmp_path / "jsonl", script(np.random.default_rng(3)))
    code = textwrap.dedent(f"""
        import sys
        from divergence.cli.main import main
        assert main(["import", {str(d)!r}, "--out", {str(tmp_path / 'x.h5')!r}]) == 0
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "torch")
                     or m.startswith("divergence.engine") or m == "divergence.engine.kernels.blas")
        print("MODS", bad)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MODS []" in out.stdout, out.stdout


def test_the_doc_lists_every_field_of_the_contract():
    from pathlib import Path

    from divergence.record.contract import FIELDS

    doc = (Path(__file__).parents[2] / "docs" / "recording.md").read_text()
    for kind, fields in FIELDS.items():
        section = doc.split(f"### `{kind}`\n", 1)[1].split("\n### ", 1)[0]
        for name in fields:
            assert f"| `{name}` |" in section, (kind, name)


def test_float32_decimals_of_up_to_9_digits_are_float32s():
    from divergence.record.contract import check

    f = np.float32(25.571232)
    base = {"step": 0, "request": "r1", "position": 5, "token": 1, "topk_ids": [1]}
    for text in ("25.571232", "25.5712318", "%.17g" % float(f), repr(float(f))):
        got = check("token", {**base, "topk_logits": [float(text)]})["topk_logits"]
        assert got.view(np.uint32)[0] == f.view(np.uint32), text
    with pytest.raises(RecordError, match="not a float32 value"):
        check("token", {**base, "topk_logits": [25.5712318001]})


def test_the_chosen_tokens_own_logit_is_kept_also_outside_the_top_k(tmp_path):
    """A sampled token outside the recorded top-k keeps its own logit (reports never say nan)."""
    path = tmp_path / "t.h5"
    ids = np.array([7, 8, 9], np.int32)
    vals = np.array([3.5, 2.25, 1.0], np.float32)
    own = np.float32(-0.123456789)
    with Recorder(path, engine="toy", schedule="serial", requests=[{"id": "r1", "prompt": [1, 2]}]) as rec:
        rec.step([("r1", "prefill", 0, 2)])
        rec.token("r1", position=2, token=40, topk_ids=ids, topk_logits=vals, logit=own)
        rec.step([("r1", "decode", 2, 1)])
        rec.token("r1", position=3, token=8, topk_ids=ids, topk_logits=vals)  # no logit given: from the top-k
    with Trace.open(path) as t:
        got = t.tokens("r1").logit
        assert got.view(np.uint32).tolist() == [own.view(np.uint32), np.float32(2.25).view(np.uint32)]

"""The engine-neutral example (examples/toy_engine.py, no divergence inside) writes JSON
Lines; imported, they diff and bisect to the batch step planted in it, and
`--confirm-cmd` confirms it by re-running the example with that step split out."""
from __future__ import annotations

import json
import shlex
import sys

import numpy as np
import pytest

from divergence import Trace
from divergence.cli.main import main

from .conftest import EXAMPLE, example

PY = shlex.quote(sys.executable)


def run_json(args, capsys):
    capsys.readouterr()
    rc = main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_the_example_does_not_import_divergence():
    import ast

    tree = ast.parse(EXAMPLE.read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert mods <= {"__future__", "argparse", "hashlib", "json", "math", "pathlib", "numpy"}, mods


def test_one_file_with_kinds_imports_to_the_same_trace(tmp_path, pair):
    example(tmp_path / "one", "--schedule", "concurrent", "--one-file")
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["records.jsonl"]
    assert main(["import", str(tmp_path / "one" / "records.jsonl"), "--out", str(tmp_path / "one.h5")]) == 0
    with Trace.open(pair[1]) as a, Trace.open(tmp_path / "one.h5") as b:
        assert list(a.iter_plans()) == list(b.iter_plans())
        for rid in ("r1", "r2"):
            assert np.array_equal(a.tokens(rid).topk_logits.view(np.uint32), b.tokens(rid).topk_logits.view(np.uint32))
            assert all(np.array_equal(a.live_kv(rid)[k], b.live_kv(rid)[k]) for k in ("k_hash", "v_hash", "step"))


def test_imported_traces_keep_the_engines_names_and_logits(tmp_path, pair):
    with Trace.open(pair[1]) as t:
        assert t.meta["settings"]["engine"].startswith("toy-engine") and t.kv_hash == "blake2b_64"
        k3 = t.kernels(step=3)
        assert set(k3["kernel"][k3["op"] != "lm_head"]) == {"mm/4"} and set(t.kernels(step=4)["kernel"]) == {"mv"}
        assert set(k3["kernel"][k3["op"] == "lm_head"]) == {"mv"}  # two logit rows
        assert "attn.k" in set(t.kernels()["op"])
    # the logits are the example's float32 values, bit for bit
    recs = [json.loads(x) for x in (pair[1].parent / "concurrent" / "tokens.jsonl").read_text().splitlines()]
    assert recs[-1] == {"kind": "end", "records": len(recs) - 1}  # the file's end record
    want = np.array([r["topk_logits"] for r in recs[:-1] if r["request"] == "r1"], np.float32)
    with Trace.open(pair[1]) as t:
        assert np.array_equal(t.tokens("r1").topk_logits.view(np.uint32), want.view(np.uint32))


def test_diff_and_bisect_find_the_planted_step(pair, capsys):
    rc, d = run_json(["diff", str(pair[0]), str(pair[1])], capsys)
    assert rc == 1
    r1, r2 = d["requests"]
    assert r1["status"] == "diverged" and r2["status"] == "identical"
    rc, b = run_json(["bisect", str(pair[0]), str(pair[1])], capsys)
    c = b["requests"][0]["root_cause"]
    # the planted cause: step 3 packs r2's prefill (6 rows) with r1's decode: 7 rows, mm/4
    assert (c["kind"], c["step_b"], c["rows_b"], c["kernel_b"], c["kernel_a"], c["co_batched_b"]) == \
           ("cache_contamination", 3, 7, "mm/4", "mv", ["r2"])
    assert c["rows_a"] == 1 and c["positions"] == [10]
    assert b["requests"][0]["first_divergent_token"]["step_b"] > c["step_b"]
    assert b["requests"][0]["confirmed"] is None


@pytest.mark.parametrize("args, confirmed", [
    ("--split-step {step}", True),  # the step split: r1's row runs alone, on mv
    ("--split-step {step} --split-requests {requests}", True),
    ("--force-kernel {step}={force}", True),  # {force} = A's kernel, mv
    ("", False),  # re-running unchanged does not fix it
    ("--split-step 0", False),  # nor does splitting another step
])
def test_confirm_cmd_reruns_the_example(pair, capsys, args, confirmed):
    cmd = f"{PY} {shlex.quote(str(EXAMPLE))} --schedule concurrent {args} --out {{out}}"
    rc, b = run_json(["bisect", str(pair[0]), str(pair[1]), "--confirm-cmd", cmd], capsys)
    assert rc == 1
    r1 = b["requests"][0]
    assert r1["confirmed"] is confirmed, r1["root_cause"]["confirm_detail"]
    if args not in ("--split-step {step}", ""):
        return
    capsys.readouterr()
    main(["bisect", str(pair[0]), str(pair[1]), "--confirm-cmd", cmd])
    text = capsys.readouterr().out
    assert ("confirmed: re-running concurrent" in text) if confirmed else ("NOT confirmed" in text), text


@pytest.mark.parametrize("cmd, needle", [
    ("false {out}", "--confirm-cmd exited 1"),
    ("true {out}", "wrote nothing"),
    ("echo {stepp} {out}", "unknown placeholder {stepp}"),
    ("echo {step}", "must write its trace to {out}"),
])
def test_confirm_cmd_bad_commands(pair, capsys, cmd, needle):
    capsys.readouterr()
    assert main(["bisect", str(pair[0]), str(pair[1]), "--confirm-cmd", cmd]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_engine_only_commands_refuse_foreign_traces(pair, capsys):
    for args in (["replay", str(pair[1])], ["replay", str(pair[1]), "--force", "3:solo"],
                 ["bisect", str(pair[0]), str(pair[1]), "--confirm"]):
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "toy-engine" in err[0] and "cannot re-execute" in err[0], err


def test_without_kv_hashes_bisect_diffs_and_does_not_try_replay(pair, tmp_path, capsys):
    import shutil

    paths = []
    for name in ("serial", "concurrent"):
        d = shutil.copytree(pair[0].parent / name, tmp_path / name)
        (d / "kv_writes.jsonl").unlink()
        assert main(["import", str(d), "--out", str(tmp_path / f"{name}.h5")]) == 0
        paths.append(str(tmp_path / f"{name}.h5"))
    rc, b = run_json(["bisect", *paths], capsys)
    assert rc == 1 and b["mode"].startswith("none") and b["requests"][0]["root_cause"] is None
    r = b["requests"][0]
    assert r["first_divergent_token"]["position"] == 43
    # no silence: the step whose logits first differ is the lead, said to be only that, with
    # the command that would confirm it through the engine that made the traces
    lead = r["root_cause_not_found"]
    step = (r["first_numeric_divergence"] or r["first_divergent_token"])["step_b"]
    assert "lead only" in lead and f"step {step} " in lead and "--confirm-cmd" in lead, lead
    capsys.readouterr()
    assert main(["bisect", *paths]) == 1
    assert "    root cause: not found (no KV hashes to walk back through" in capsys.readouterr().out


def test_ops_asked_for_foreign_traces_says_it_is_not_looked_for(pair, capsys):
    capsys.readouterr()
    assert main(["bisect", str(pair[0]), str(pair[1]), "--ops"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["note: --ops replays one device op by op with divergence's engine, and they are another "
                   "engine's: the first op that differed is not looked for"], err

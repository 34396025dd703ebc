"""`divergence redact`: a pair without its text gives the same diff and bisect (cause, step,
op, margins) with none of its token ids the original one at that place; every token id of
both traces goes through one derangement, the vocabulary goes, the content hashes are
keyed, no old byte stays in the file; replay refuses the copy, browse shows ids."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from divergence.cli.main import main
from divergence.trace import schema as S
from divergence.trace.reader import Trace
from divergence.trace.redact import (
    HASH_COLUMNS, REDACTED_ATTR, TOKEN_COLUMNS, TOKENS, Redaction, _changes, _token_places, is_redacted,
)

V1 = Path(__file__).parents[2] / "traces" / "v1"
TOKEN_KEYS = ("token", "runner_up")  # keys of a report's JSON that hold token ids


def _cli(capsys, *argv) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err.strip().splitlines()


@pytest.fixture(scope="module")
def v1_pair(tmp_path_factory):
    """The committed schema-1 pair: r1 diverges at position 127, cache contamination at step 8."""
    d = tmp_path_factory.mktemp("v1")
    for name in ("serial.h5", "concurrent.h5"):
        shutil.copy(V1 / name, d / name)
    return d / "serial.h5", d / "concurrent.h5"


@pytest.fixture(scope="module")
def fixture_pair(tmp_path_factory):
    """A schema-2 pair: `divergence run` of the fixture models under the demo settings
    (threshold:4, a draft), the built-in prompts plus a sampled request (draws hold ids too)."""
    from divergence.workloads.prompts import DEMO

    d = tmp_path_factory.mktemp("fixture")
    sampled = {"id": "sampled", "prompt": DEMO[0]["prompt"], "max_tokens": 24, "temperature": 0.8, "top_p": 0.95,
               "seed": 7}
    (d / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (*DEMO, sampled)))
    assert main(["run", "--prompts", str(d / "prompts.jsonl"), "--out", str(d / "out")]) == 0
    return d / "out" / "serial.h5", d / "out" / "concurrent.h5"


@pytest.fixture(scope="module", params=["v1", "fixture"])
def pair(request, tmp_path_factory):
    """(original A, original B, redacted A, redacted B)."""
    a, b = request.getfixturevalue(f"{request.param}_pair")
    out = tmp_path_factory.mktemp(f"redacted-{request.param}")
    assert main(["redact", str(a), str(b), "--out", str(out)]) == 0
    return a, b, out / a.name, out / b.name


def _without_tokens(obj, mapping=None):
    """A report's JSON with its token ids left out (with `mapping`: mapped), what redaction
    must keep; a sampler story's text names its tokens ('token 840'): mapped there."""
    if isinstance(obj, dict):
        out = {k: _without_tokens(v, mapping) for k, v in obj.items() if k not in TOKEN_KEYS}
        if "sampler" in obj and isinstance(obj["sampler"], dict) and mapping is not None:
            text = re.sub(r"token (\d+)", lambda m: f"token {mapping[int(m.group(1))]}", obj["sampler"]["text"])
            out["sampler"] = {**out["sampler"], "text": text}
        return out
    if isinstance(obj, list):
        return [_without_tokens(v, mapping) for v in obj]
    return obj


def _token_sites(obj, path=()):
    """{path in the JSON: token id} of every token id a report names."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in TOKEN_KEYS and isinstance(v, int):
                out[path + (k,)] = v
            else:
                out.update(_token_sites(v, path + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_token_sites(v, path + (i,)))
    return out


@pytest.mark.parametrize("command", ["diff", "bisect"])
def test_the_redacted_pair_gives_the_same_cause_step_and_op(pair, capsys, command):
    a, b, ra, rb = pair
    rc, out, _ = _cli(capsys, command, a, b, "--json")
    red_rc, red_out, _ = _cli(capsys, command, ra, rb, "--json")
    original, redacted = json.loads(out), json.loads(red_out)
    assert rc == red_rc == 1  # both diverge
    for report, paths in ((original, (a, b)), (redacted, (ra, rb))):
        assert (report.pop("a"), report.pop("b")) == tuple(map(str, paths))
    sites, red_sites = _token_sites(original), _token_sites(redacted)
    assert sites.keys() == red_sites.keys() and sites
    mapping = {sites[k]: red_sites[k] for k in sites}
    assert _without_tokens(redacted) == _without_tokens(original, mapping)
    diverged = [r for r in original["requests"] if r["status"] == "diverged"]
    assert diverged
    if command == "bisect":
        causes = [r["root_cause"] for r in diverged if r.get("root_cause")]
        assert causes and all(c["kind"] and c["step_b"] is not None for c in causes)
        assert any(c.get("op") for c in causes)  # the op whose kernel wrote the first differing K/V
    firsts = [k for k in sites if "first_divergent_token" in k]
    assert firsts
    for k in sites:  # none is the original id at that place
        assert red_sites[k] != sites[k], k


def test_the_text_reports_show_ids_not_the_vocabulary(pair, capsys):
    a, b, ra, rb = pair
    with Trace.open(a) as t:
        vocab = t.vocab
    _, out, _ = _cli(capsys, "bisect", ra, rb)
    assert "root cause:" in out
    first = next(line for line in out.splitlines() if "runner-up" in line)
    pieces = {repr(p) for p in vocab if len(p) > 1}
    assert not any(p in first for p in pieces), first  # the original prints each token's text


def _places(f: h5py.File):
    for path, fields in _token_places(f):
        data = f[path][()]
        for name in fields:
            yield (path, name), np.asarray(data if name is None else data[name])


def test_every_token_id_of_both_traces_goes_through_one_derangement(pair):
    a, b, ra, rb = pair
    mapping: dict[int, int] = {}
    seen_places = set()
    for orig, red in ((a, ra), (b, rb)):
        with h5py.File(orig, "r") as fo, h5py.File(red, "r") as fr:
            for (place, o), (place_r, r) in zip(_places(fo), _places(fr), strict=True):
                assert place == place_r and o.shape == r.shape, place
                real = o >= 0
                assert (r[~real] == o[~real]).all(), f"{place}: padding / 'none' ids must stay"
                assert not (r[real] == o[real]).any(), f"{place}: an id kept its value"
                for x, y in zip(o[real].tolist(), r[real].tolist()):
                    assert mapping.setdefault(x, y) == y, f"{place}: id {x} mapped two ways"
                if real.any():
                    seen_places.add(place[0].removeprefix(f"{S.TAILS}/"))
    assert len(set(mapping.values())) == len(mapping)  # one permutation: no two ids onto one
    want = {"requests/prompt_tokens"} | ({"tokens/token", "tokens/topk_ids", "slices/input_tokens/value"}
                                         if "tokens/token" in seen_places else {"tokens", "slice_tokens", "draws"})
    assert want <= seen_places, want - seen_places
    with Trace.open(a) as to, Trace.open(ra) as tr:  # the reader sees the mapped prompts and tokens
        for q, qr in zip(to.requests, tr.requests, strict=True):
            assert qr.id == q.id and qr.prompt_tokens == tuple(mapping[x] for x in q.prompt_tokens)
            assert tr.tokens(q.id).tokens.tolist() == [mapping[x] for x in to.tokens(q.id).tokens.tolist()]
        eos = to.meta["model"]["config"]["eos_token_id"]
        assert tr.meta["model"]["config"]["eos_token_id"] == mapping.get(eos, tr.meta["model"]["config"]["eos_token_id"])
        assert tr.meta["model"]["config"]["eos_token_id"] != eos


def test_hashes_are_keyed_and_equal_ones_stay_equal(pair):
    a, b, ra, rb = pair
    cols = {}
    for which, paths in (("orig", (a, b)), ("red", (ra, rb))):
        got = []
        for p in paths:
            with Trace.open(p) as t:
                h = t.kv_hashes()
                got.append(np.concatenate([np.asarray(h["k_hash"]), np.asarray(h["v_hash"])]))
        cols[which] = np.concatenate(got)
    o, r = cols["orig"], cols["red"]
    assert o.size and o.shape == r.shape
    assert not (o[o != 0] == r[o != 0]).any()
    # the same partition: equal originals are equal redacted, and unequal stay unequal
    _, inv_o = np.unique(o, return_inverse=True)
    _, inv_r = np.unique(r, return_inverse=True)
    assert len(set(zip(inv_o.tolist(), inv_r.tolist()))) == len(set(inv_o.tolist())) == len(set(inv_r.tolist()))


def test_the_vocabulary_goes_no_old_byte_stays_and_the_copy_is_marked(pair):
    a, b, ra, rb = pair
    for orig, red in ((a, ra), (b, rb)):
        with h5py.File(orig, "r") as f:
            blob = f[S.VOCAB]["bytes"][()].tobytes()
            prompts = f[S.REQUESTS]["prompt_tokens"][()]
        with Trace.open(red) as t:
            assert is_redacted(t) and t.vocab is None
            assert json.loads(t.f.attrs[REDACTED_ATTR])["vocab"] == "removed"
        raw = red.read_bytes()
        assert blob and blob not in raw  # the vocabulary's bytes, nowhere (not in free space either)
        longest = prompts.astype("<i4").tobytes()
        assert len(longest) > 16 and longest not in raw  # /requests is stored uncompressed: its old ids are gone


def test_replay_confirm_and_rerun_refuse_a_redacted_trace(pair, capsys, tmp_path):
    _, _, ra, rb = pair
    for argv in (["replay", ra], ["bisect", ra, rb, "--confirm"], ["rerun", ra, "--out", tmp_path / "rr"]):
        rc, _, err = _cli(capsys, *argv)
        assert rc == 2 and len(err) == 1 and "redacted" in err[0] and "Traceback" not in err[0], (argv, err)
    assert not (tmp_path / "rr").exists()


def test_browse_shows_redacted_tokens_as_ids(pair):
    from divergence.tui.data import BrowseData

    ra, rb = pair[2:]
    with Trace.open(ra) as t:
        q = t.requests[0]
    data = BrowseData.open(ra, rb)
    try:
        assert data.vocab is None
        assert data.prompt_text(q.id) == " ".join(map(str, q.prompt_tokens))
        assert isinstance(data.text(q.prompt_tokens[0]), str)  # no vocabulary: shown, not raised
    finally:
        data.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_the_browser_opens_a_redacted_pair_and_no_key_breaks_it(pair, anyio_backend):
    from divergence.tui.app import BrowseApp
    from divergence.tui.data import BrowseData

    data = BrowseData.open(*pair[2:])
    app = BrowseApp(data)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            for keys in ((), ("d",), ("enter",), ("t",), ("b", "k"), ("b", "s")):
                await pilot.press(*keys)
                await pilot.pause()
                await app.workers.wait_for_complete()
                await pilot.pause()
            assert data.analysis_error is None and data.bisect is not None
            assert any(r.status == "diverged" for r in data.diff.requests)
    finally:
        data.close()


def test_bad_pairs_are_one_line_and_exit_2(v1_pair, capsys, tmp_path):
    a, b = v1_pair
    out = tmp_path / "red"
    assert main(["redact", str(a), str(b), "--out", str(out)]) == 0
    (tmp_path / "text.h5").write_text("not a trace\n")
    cases = [
        (["redact", a, a, "--out", tmp_path / "x"], "one file"),
        (["redact", out / "serial.h5", b, "--out", tmp_path / "y"], "already redacted"),
        (["redact", tmp_path / "text.h5", b, "--out", tmp_path / "z"], "text.h5"),
        (["redact", a, b, "--out", a.parent], "inputs"),  # would write over the inputs
    ]
    for argv, says in cases:
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        rc, _, err = _cli(capsys, *argv)
        assert rc == 2 and len(err) == 1 and says in err[0], (argv, err)
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    for d in ("x", "y", "z"):
        assert not (tmp_path / d).exists()


def test_a_fresh_secret_each_time(v1_pair, tmp_path):
    a, b = v1_pair
    got = []
    for d in ("one", "two"):
        assert main(["redact", str(a), str(b), "--out", str(tmp_path / d)]) == 0
        with h5py.File(tmp_path / d / "serial.h5", "r") as f:
            got.append(f[S.REQUESTS]["prompt_tokens"][()])
    assert (got[0] != got[1]).any()  # not a fixed permutation: nothing to invert from another copy
    for vocab in (2, 3, 1024):
        r = Redaction(vocab)
        assert sorted(r.perm.tolist()) == list(range(vocab)) and not (r.perm == np.arange(vocab)).any()


def test_every_token_column_of_the_schema_is_mapped():
    """A new column holding token ids must be listed in TOKEN_COLUMNS (named token, *_token or
    *_ids, or the `value` of a *token* table)."""
    holds_ids = {(name, c) for name, t in S.TABLES.items() for c in t.columns
                 if c == "token" or c.endswith(("_token", "_ids")) or (c == "value" and "token" in name)}
    listed = {(name, c) for name, cols in TOKEN_COLUMNS.items() for c in cols}
    assert holds_ids == listed
    hashed = {(name, c) for name, t in S.TABLES.items() for c in t.columns if c.endswith("_hash")}
    assert hashed == {(name, c) for name, cols in HASH_COLUMNS.items() for c in cols}


def test_schema_1_and_2_places(v1_pair, fixture_pair):
    with h5py.File(v1_pair[0], "r") as f:
        c = _changes(f)
        assert c["tokens/topk_ids"] == {None: TOKENS} and c["slices/input_tokens/value"] == {None: TOKENS}
    with h5py.File(fixture_pair[0], "r") as f:
        c = _changes(f)
        assert c["tokens"]["topk_ids"] == TOKENS and c[f"{S.TAILS}/tokens"]["token"] == TOKENS

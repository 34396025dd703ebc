"""One analysis, every front end: `divergence bisect --json`, the HTML page (`report`), the
pytest plugin's comparison and the browser's data all get a pair's analysis from
analysis.pipeline, so they must name the same cause (kind, steps, layer), the same
confirmation and the same first op, on pairs that take different paths through it: the
demo's (KV hashes, a cache contamination) and the same run without KV hashes (the replay
bisection). The browser runs no replays: it must give the same leads."""
from __future__ import annotations

import json

import pytest

from divergence import Trace
from divergence.cli.main import main


@pytest.fixture(scope="module", params=["kv-hashes", "no-kv-hashes"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    args = ["run", "--out", str(d), "--json"] + (["--no-kv-hashes"] if request.param == "no-kv-hashes" else [])
    assert main(args) == 1  # the demo diverges
    return d / "serial.h5", d / "concurrent.h5"


def _cause(c: dict | None):
    if c is None:
        return None
    op = c.get("first_op")
    return (c["kind"], c["step_a"], c["step_b"], c["layer"], tuple(c["positions"]),
            (op["layer"], op["op"]) if op else None)


def test_every_front_end_names_the_same_cause_confirmation_and_first_op(pair, tmp_path, capsys):
    from divergence.testing.assertions import _compare
    from divergence.tui.data import BrowseData

    a, b = pair
    capsys.readouterr()
    assert main(["bisect", str(a), str(b), "--confirm", "--json"]) == 1
    cli = {r["id"]: r for r in json.loads(capsys.readouterr().out)["requests"]}
    causes = {rid: _cause(r["root_cause"]) for rid, r in cli.items()}
    assert any(causes.values()), cli
    assert all(r["confirmed"] for r in cli.values() if r["root_cause"]), cli

    # the pytest plugin's comparison
    with Trace.open(a) as ta, Trace.open(b) as tb:
        plugin = {r["id"]: r for r in _compare(ta, tb, confirm=True).report.to_json()["requests"]}
    assert {rid: _cause(r["root_cause"]) for rid, r in plugin.items()} == causes
    assert {rid: r["confirmed"] for rid, r in plugin.items()} == {rid: r["confirmed"] for rid, r in cli.items()}
    assert {rid: r["root_cause"] and r["root_cause"]["confirm_detail"] for rid, r in plugin.items()} == \
        {rid: r["root_cause"] and r["root_cause"]["confirm_detail"] for rid, r in cli.items()}

    # the HTML page: written from the same report, so it carries the same sentences
    page = tmp_path / "r.html"
    assert main(["report", str(a), str(b), "--confirm", "--html", str(page)]) == 1
    html = page.read_text()
    for rid, r in cli.items():
        c = r["root_cause"]
        if c:
            assert f"step {c['step_b']}" in html, rid
            if c.get("first_op"):
                assert c["first_op"]["op"] in html, rid

    # the browser: the same leads, without replays (KV hashes) or none (the replay bisection needs replays)
    data = BrowseData.open(a, b)
    try:
        data.analyse()
        tui = {rid: _cause(c.to_json()) for rid, c in data.bisect.causes.items()}
    finally:
        data.close()
    with Trace.open(a) as ta:
        hashed = ta.has_kv_hashes
    if hashed:
        assert {rid: k[:5] for rid, k in tui.items()} == {rid: k[:5] for rid, k in causes.items() if k}
    else:
        assert tui == {}

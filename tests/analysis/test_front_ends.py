"""One analysis, every front end: `divergence bisect --json`, the HTML page (`report`), the
pytest plugin's comparison and the browser's data all get a pair's analysis from
analysis.pipeline, so they must name the same cause (kind, steps, layer), the same
confirmation and the same first op, on pairs that take different paths through it: the
own serial vs concurrent (KV hashes, a cache contamination), without KV hashes (the replay
bisection), warm, the prefix cache, sampled speculative decoding, a mixture of experts,
TP=1 vs TP=2 (the plugin, in no group, replays the TP side in child ranks), and another
engine's imported pair (confirmed by its command). The browser runs no replays: it
must give the same leads.""" 
from __future__ import annotations

import json

import pytest

from divergence import Trace
from divergence.cli.main import main


PROMPTS = [{"id": "r1", "prompt": "Return the number of items in the", "max_tokens": 16},
           {"id": "r2", "prompt": "Open file and return a stream. Raise OSError upon failure.", "max_tokens": 12,
            "arrival": 2},
           {"id": "r3", "prompt": "Return the number of", "max_tokens": 12, "arrival": 3}]
# pair -> `divergence run` options (the demo's threshold:4 and spec k=3 unless said) and its schedules
PAIRS = {
    "kv-hashes": ([], "serial,concurrent"),
    "no-kv-hashes": (["--no-kv-hashes"], "serial,concurrent"),
    "warm": (["--builtin"], "serial,warm"),  # the demo's prompts: r2's 154 tokens meet its warm-up copy
    "prefix-cache": (["--prefix-cache"], "serial,concurrent"),
    "sampled-speculative": (["--temperature", "0.8", "--top-p", "0.95", "--seed", "3"], "serial,concurrent"),
    "moe": (["--policy", "threshold:1", "--spec-k", "0"], "serial,concurrent"),
    "foreign": (None, "serial,concurrent"),  # examples/toy_engine.py's JSON Lines, imported
    "tp1-vs-tp2": (["--tp"], "serial,serial"),  # one schedule at TP=1 and at TP=2 (the target alone, fp32)
}


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    opts, schedules = PAIRS[request.param]
    first, second = schedules.split(",")
    if opts is None:
        from tests.record.conftest import toy_pair

        return toy_pair(d, (first, second))
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    if opts == ["--tp"]:
        from divergence.cli.common import default_model_dirs

        for tp in (1, 2):
            assert main(["run", "--model", str(default_model_dirs()[0]), "--dtype", "float32", "--prompts",
                         str(prompts), "--max-tokens", "8", "--policy", "threshold:4", "--ignore-eos", "--tp",
                         str(tp), "--schedules", first, "--out", str(d / f"tp{tp}"), "--json"]) == 0
        return d / "tp1" / f"{first}.h5", d / "tp2" / f"{first}.h5"
    args = ["run", "--schedules", schedules, "--out", str(d), "--json", *(o for o in opts if o != "--builtin")]
    if "--builtin" not in opts:
        args += ["--prompts", str(prompts)]
    if request.param == "moe":
        from divergence.testing.models import make_random_model

        model = make_random_model(d / "m", model_type="mixtral", hidden_size=64, num_layers=2, num_experts=8,
                                  experts_per_token=2, dtype="bfloat16")
        args += ["--model", str(model), "--ignore-eos"]
    assert main(args) in (0, 1)
    return d / f"{first}.h5", d / f"{second}.h5"


def _cause(c: dict | None):
    if c is None:
        return None
    op = c.get("first_op")
    return (c["kind"], c["step_a"], c["step_b"], c["layer"], tuple(c["positions"]),
            (op["layer"], op["op"]) if op else None)


def test_every_front_end_names_the_same_cause_confirmation_and_first_op(pair, tmp_path, capfd):
    # (capfd: a TP pair's bisect prints from its rank 0, a child process)
    from divergence.testing.assertions import _compare
    from divergence.tui.data import BrowseData

    from divergence.analysis.pipeline import foreign

    a, b = pair
    with Trace.open(a) as ta, Trace.open(b) as tb:
        other = foreign(ta, tb)
    # another engine's pair is confirmed through that engine (--confirm-cmd), not by replay
    confirm = ["--confirm-cmd", _toy_rerun()] if other else ["--confirm"]
    capfd.readouterr()
    assert main(["bisect", str(a), str(b), "--bitwise", *confirm, "--json"]) == 1
    cli = {r["id"]: r for r in json.loads(capfd.readouterr().out)["requests"]}
    causes = {rid: _cause(r["root_cause"]) for rid, r in cli.items()}
    assert any(causes.values()), cli
    assert all(r["confirmed"] for r in cli.values() if r["root_cause"]), cli

    # the pytest plugin's comparison (it replays with this engine: another engine's pair is compared unconfirmed)
    with Trace.open(a) as ta, Trace.open(b) as tb:
        plugin = {r["id"]: r for r in _compare(ta, tb, confirm=not other, bitwise=True).report.to_json()["requests"]}
    if other:
        assert {rid: _cause(r["root_cause"]) for rid, r in plugin.items()} == causes
        return
    assert {rid: _cause(r["root_cause"]) for rid, r in plugin.items()} == causes
    assert {rid: r["confirmed"] for rid, r in plugin.items()} == {rid: r["confirmed"] for rid, r in cli.items()}
    assert {rid: r["root_cause"] and r["root_cause"]["confirm_detail"] for rid, r in plugin.items()} == \
        {rid: r["root_cause"] and r["root_cause"]["confirm_detail"] for rid, r in cli.items()}

    # the HTML page: written from the same report, so it carries the same sentences
    page = tmp_path / "r.html"
    assert main(["report", str(a), str(b), "--bitwise", "--confirm", "--html", str(page)]) == 1
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
    if hashed:  # browse compares tokens (no --bitwise): its leads are those of the requests whose tokens differ
        flipped = {rid for rid, r in cli.items() if r["first_divergent_token"] is not None}
        assert set(tui) == flipped and all(k[:5] == causes[rid][:5] for rid, k in tui.items()), (tui, causes)
    else:
        assert tui == {}


def _toy_rerun() -> str:
    """The toy engine's re-run of B with the cause step split (docs/recording.md)."""
    import shlex
    import sys

    from tests.record.conftest import EXAMPLE

    return f"{shlex.quote(sys.executable)} {shlex.quote(str(EXAMPLE))} --schedule concurrent --split-step {{step}} --out {{out}}"

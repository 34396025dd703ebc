"""`divergence report ... --html` and `bisect ... --html`: the page is written, JSON stays
JSON, and bad input is one line with exit 2 and no page."""
from __future__ import annotations

import json

import h5py
import pytest

from divergence.cli.main import main

from tui import story  # noqa: E402  (the browser tests' synthetic story pair)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return story.write_pair(tmp_path_factory.mktemp("pair"))


def run(args, capsys):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err.strip().splitlines()


def test_report_writes_the_page(pair, tmp_path, capsys):
    out = tmp_path / "sub" / "r.html"
    rc, stdout, err = run(["report", *pair, "--html", out], capsys)
    assert rc == 1 and not err and stdout.startswith(f"html report: {out}")
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and "root cause: cache contamination" in html


def test_bisect_html_keeps_stdout_json(pair, tmp_path, capsys):
    out = tmp_path / "b.html"
    rc, stdout, err = run(["bisect", *pair, "--html", out, "--json"], capsys)
    assert rc == 1  # diverged, as without --html
    assert json.loads(stdout)["requests"][0]["root_cause"]["kind"] == "cache_contamination"
    assert err == [f"html report: {out} ({out.stat().st_size / 1024:.0f} KiB)"]
    rc, stdout, _ = run(["report", *pair, "--html", out, "--json"], capsys)
    assert rc == 1 and json.loads(stdout)["html"] == str(out)


def _foreign(d):
    p = d / "foreign.h5"
    with h5py.File(p, "w") as f:
        f["x"] = [1, 2, 3]
    return p


@pytest.mark.parametrize("make, needle", [
    (lambda d, p: [p[0], d / "missing.h5", "--html", d / "o.html"], "no such trace"),
    (lambda d, p: [p[0], _foreign(d), "--html", d / "o.html"], "not a divergence trace"),
    (lambda d, p: [p[0], story.write_run(d / "other.h5", "concurrent", weights_hash="0ther"), "--html",
                   d / "o.html"], "different models"),
    (lambda d, p: [p[0], story.write_run(d / "fewer.h5", "concurrent", story.requests()[:2]), "--html",
                   d / "o.html"], "different requests"),
    (lambda d, p: [p[0], story.write_run(d / "prompts.h5", "concurrent", _other_prompt()), "--html",
                   d / "o.html"], "different prompts"),
    (lambda d, p: [*p, "--html", d], "is a directory"),
])
@pytest.mark.parametrize("cmd", ["report", "bisect"])
def test_bad_input_is_one_line_and_no_page(pair, tmp_path, capsys, make, needle, cmd):
    rc, _, err = run([cmd, *make(tmp_path, pair)], capsys)
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o.html").exists()


def _other_prompt():
    from dataclasses import replace

    reqs = story.requests()
    reqs[0] = replace(reqs[0], prompt_tokens=(0, 12, 4, 5, 6, 8))
    return reqs


def test_report_needs_html(pair, capsys):
    rc, _, err = run(["report", *pair], capsys)
    assert rc == 2 and len(err) == 1 and "--html" in err[0]

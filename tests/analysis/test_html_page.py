"""The HTML report on synthetic traces (fast, no model): every section renders from
what the traces and the bisect report hold, the page stays small and self-contained,
and traces without KV hashes, killed runs and identical pairs still give a page."""
from __future__ import annotations

import re

import pytest

from divergence.analysis.bisect import bisect_traces
from divergence.analysis.html import render_html
from divergence.analysis.report import render_bisect
from divergence.trace.reader import Trace

from tui import story  # noqa: E402  (tests/ is on sys.path: the synthetic story pair of the browser's tests)

URL = re.compile(r"https?://", re.I)
ATTR = re.compile(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]*)""", re.I)


def page(pa, pb) -> tuple[str, object]:
    with Trace.open(pa) as a, Trace.open(pb) as b:
        rep = bisect_traces(a, b)
        return render_html(rep, a, b), render_bisect(rep, a.vocab)


def self_contained(html: str) -> None:
    assert not URL.search(html), URL.search(html)
    assert not re.search(r"url\(\s*['\"]?(?!#|data:)", html), "a CSS/SVG url() that is not inline"
    refs = ATTR.findall(html)
    assert all(r.startswith(("data:", "#")) for r in refs), [r for r in refs if not r.startswith(("data:", "#"))]
    assert "<script" not in html.lower() and "<link" not in html.lower() and "@import" not in html


def test_story_pair_page_holds_every_section(tmp_path):
    pa, pb = story.write_pair(tmp_path)
    html, text = page(pa, pb)
    self_contained(html)
    s = story.STORY
    # the root-cause text is the CLI's, line for line
    for line in text.splitlines():
        if "root cause" in line or "written in" in line or "first divergent token" in line:
            assert line.strip().replace("'", "&#x27;") in html, line
    assert f"concurrent step {s.contaminating_step}" in html
    for sec in ("summary", "root-cause", "settings", "requests", "timeline"):
        assert f"id={sec}" in html
    # one margin plot and one KV grid for the one diverged request, a timeline; all inline SVG
    assert html.count("class='figure margin-plot'") == 1 and html.count("class='figure kv-grid'") == 1
    assert html.count("class='figure timeline-plot'") == 1 and html.count("<svg") == 3
    assert f">first numeric difference (position {s.numeric_position})</text>" in html
    assert f">flip (position {s.flip_position})</text>" in html
    # the first divergent token is marked in both texts
    assert html.count("<mark class=flip") == 2
    # the earliest differing KV cell is the contaminated position
    assert f"earliest: layer 0, position {s.contaminated_position}" in html
    # the root-cause step is highlighted in B's step table, with the co-batched request shown
    table_b = html[html.index("id=steps-b"):]
    row = re.search(r"<tr class='cause'><td>%d <span class=note>root cause of r1</span></td>.*?</tr>"
                    % s.contaminating_step, table_b)
    assert row and "r2 prefill" in row.group(0)


def test_settings_of_both_sides_and_what_differs(tmp_path):
    pa, pb = story.write_pair(tmp_path)
    html, _ = page(pa, pb)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        env = a.meta["environment"]
    settings = html[html.index("id=settings"):]
    for name in ("schedule", "model", "kernel policy", "TP degree", "BLAS", "device", "versions"):
        assert f"<th>{name}</th>" in settings
    assert "<tr class='differs'><th>schedule</th><td>serial</td><td>concurrent</td></tr>" in settings
    for v in env.values():
        assert str(v) in settings


def test_no_kv_hashes_killed_runs_and_identical_pairs_still_render(tmp_path):
    pa = story.write_run(tmp_path / "serial.h5", "serial", kv_hashes=False)
    pb = story.write_run(tmp_path / "concurrent.h5", "concurrent", kv_hashes=False)
    html, _ = page(pa, pb)
    self_contained(html)
    assert "recorded without KV hashes" in html and "class='figure margin-plot'" in html
    killed = story.write_run(tmp_path / "killed.h5", "concurrent", stop_after=6)
    html, _ = page(story.write_run(tmp_path / "s2.h5", "serial"), killed)
    assert "is incomplete" in html
    html, _ = page(pa, pa)
    assert "identical: 3 of 3 requests" in html and "No root cause" in html and "<mark" not in html


def test_a_long_run_gives_a_small_page(tmp_path):
    """5,000 tokens diverging at 3,000: curves, KV grid and texts are thinned, not the page bloated."""
    pa = story.write_long(tmp_path / "serial.h5", "serial", 5000)
    pb = story.write_long(tmp_path / "concurrent.h5", "concurrent", 5000, flip_at=3000)
    html, _ = page(pa, pb)
    self_contained(html)
    assert len(html.encode()) < 400_000, len(html.encode())
    assert "(position 3000)</text>" in html and "generated tokens]" in html


def test_settings_rows_name_tp_and_keys_added_later():
    from divergence.analysis.html.data import settings_rows

    tp = {"degree": 2, "backend": "ring", "world": ["127.0.0.1", "127.0.0.1"], "launcher": "divergence"}
    a = {"schedule": "serial", "settings": {"tp": tp, "new_knob": 3}, "environment": {"blas": "OpenBLAS"}}
    b = {"schedule": "concurrent", "settings": {}, "environment": {"blas": "reference", "gpu_clock": "1.9 GHz"}}
    rows = {name: (va, vb) for name, va, vb in settings_rows(a, b)}
    assert rows["TP degree"] == ("2 (ring, ranks on 127.0.0.1)", "1")
    assert rows["BLAS"] == ("OpenBLAS", "reference")
    assert rows["new knob"] == ("3", "-") and rows["gpu clock"] == ("-", "1.9 GHz")


def test_the_committed_schema_1_demo_pair_renders():
    """traces/v1 (the demo pair as the first trace schema wrote it): an old file's page has
    every section too."""
    from pathlib import Path

    d = Path(__file__).parents[2] / "traces" / "v1"
    html, text = page(d / "serial.h5", d / "concurrent.h5")
    self_contained(html)
    assert "root cause: cache contamination" in html and html.count("<svg") == 3
    assert "<mark class=flip" in html and "id=steps-b" in html


def test_plugin_pages_one_per_compared_pair_and_never_an_error(tmp_path):
    """checker.write_pages: report.html for one pair, report-<schedule>.html for several; a page
    that can't be written is a note, not an exception (it must not hide the test's failure)."""
    from divergence.testing.checker import write_pages

    pa, pb = story.write_pair(tmp_path)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        rep = bisect_traces(a, b)
    paths = {"serial": str(pa), "concurrent": str(pb)}
    assert write_pages(rep, paths) == [str(tmp_path / "report.html")]
    assert write_pages({"concurrent": rep, "warm": rep}, paths) == [
        str(tmp_path / "report-concurrent.html"), str(tmp_path / "report-warm.html")]
    (tmp_path / "gone.h5").write_bytes(b"not a trace")
    notes = write_pages(rep, {"serial": str(pa), "concurrent": str(tmp_path / "gone.h5")})
    assert len(notes) == 1 and notes[0].startswith("(html report not written: TraceError:")


def test_another_engines_imported_traces_render(tmp_path):
    """Traces `divergence import` made from examples/toy_engine.py (no vocab, its own op and
    kernel names, no draft, no BLAS): the page still holds the cause, texts and figures."""
    import subprocess
    import sys
    from pathlib import Path

    from divergence.cli.main import main

    example = Path(__file__).parents[2] / "examples" / "toy_engine.py"
    for s in ("serial", "concurrent"):
        subprocess.run([sys.executable, str(example), "--out", str(tmp_path / s), "--schedule", s], check=True,
                       timeout=120)
        assert main(["import", str(tmp_path / s), "--out", str(tmp_path / f"{s}.h5")]) == 0
    html, text = page(tmp_path / "serial.h5", tmp_path / "concurrent.h5")
    self_contained(html)
    assert "root cause: cache contamination" in html and html.count("<svg") == 3
    assert "<td class=kv>attn.q</td>" in html  # the engine's own op names


def test_root_cause_keys_added_later_are_shown_and_missing_ones_tolerated(tmp_path):
    """The page renders whatever BisectReport.to_json() offers: an unknown key is listed as is,
    and a report whose cause JSON lacks the optional keys still renders."""
    pa, pb = story.write_pair(tmp_path)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        rep = bisect_traces(a, b)
        full = rep.to_json

        def extra():
            j = full()
            rc = j["requests"][0]["root_cause"]
            rc["first_op_that_differed"] = {"layer": 0, "op": "k_proj"}
            for k in ("kernels_a", "kernels_b", "composition_a", "composition_b", "confirm_detail"):
                rc.pop(k)
            return j

        rep.to_json = extra
        html = render_html(rep, a, b)
    self_contained(html)
    assert "<th class=kv>first op that differed</th>" in html
    assert "<th class=kv>op</th><td>k_proj</td>" in html
    assert "root cause: cache contamination" in html


def test_a_cause_the_replay_bisection_did_not_find_is_said_on_the_page(tmp_path):
    """No KV hashes and a bisector that finds nothing: the request's card and the text report
    both say why, not only that there is no cause."""
    pa = story.write_run(tmp_path / "serial.h5", "serial", kv_hashes=False)
    pb = story.write_run(tmp_path / "concurrent.h5", "concurrent", kv_hashes=False)
    why = "not found by replay: its 3 steps, every one run as in serial, still do not make it match"
    with Trace.open(pa) as a, Trace.open(pb) as b:
        rep = bisect_traces(a, b, replay_bisector=lambda rd: (None, 1, why))
        assert rep.unexplained and not rep.causes
        html, text = render_html(rep, a, b), render_bisect(rep, a.vocab)
        assert f"root cause: {why}" in text and why in html
        assert all(r.get("root_cause_not_found") == why for r in rep.to_json()["requests"] if r["id"] in rep.unexplained)


def test_margin_plot_labels_sit_above_the_curves_not_on_them(tmp_path):
    """The two labels live in a strip of their own above the margin axes, on separate rows
    (positions 10 and 14 are close: side by side they would overlap), and the legend is below."""
    from divergence.analysis.html import data as D
    from divergence.analysis.html.plots import margin_plot

    pa, pb = story.write_pair(tmp_path)
    s = story.STORY
    with Trace.open(pa) as a, Trace.open(pb) as b:
        svg = margin_plot(D.margin_series(a, b, "r1", s.flip_position, s.numeric_position), "serial", "concurrent")

    def y_of(label):  # matplotlib writes each text as <text ... x="…" y="…" ...>label</text>
        m = re.search(r'<text[^>]*\bx="([\d.]+)" y="([\d.]+)"[^>]*>' + re.escape(label) + "</text>", svg)
        assert m, label
        return float(m.group(1)), float(m.group(2))

    xn, yn = y_of(f"first numeric difference (position {s.numeric_position})")
    xf, yf = y_of(f"flip (position {s.flip_position})")
    assert yn < yf - 8  # two rows, the numeric difference's above the flip's
    # both above the top of the margin axes (whose y label is centred on them)
    patch = re.search(r'<g id="axes_2">.*?<path d="([^"]*)"', svg, re.S)  # the margin axes' background
    top = min(float(y) for y in re.findall(r"[ML] [\d.]+ ([\d.]+)", patch.group(1)))
    assert yf < top, (yf, top)
    legend = y_of("max |Δlogit| A vs B")[1]
    assert legend > y_of("sequence position")[1]  # the legend under the x axis label


def test_more_from_the_bisect_report_is_readable():
    from divergence.analysis.html.page import _more

    out = _more({"kind": "cache_contamination", "model": "target",
                 "first_op": {"layer": 0, "op": "q_proj", "positions": [9, 10, 11, 12], "max_abs_delta": 0.03125,
                              "equal_before": ["input_layernorm"], "text": "max |Δ| 0.031"}})
    assert "\\u0394" not in out and "max |Δ| 0.031" in out
    assert "{" not in out and "[" not in out  # no raw JSON: nested keys are rows of their own
    assert "<th class=kv>first op</th>" in out and "<th class=kv>positions</th><td>9-12</td>" in out
    assert "<th class=kv>equal before</th><td>input_layernorm</td>" in out

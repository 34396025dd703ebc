"""The demo pair's HTML page (`divergence run` on the embedded models, then `divergence
report --confirm`) in a real browser: headless Chromium, offline, from file://. The DOM
it parsed holds the root-cause text and the plots as SVG, the screenshot is not blank,
and the file names no http(s) resource."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from divergence.cli.main import main

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium; "
                                                             ".ci/run installs it)")


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory):
    """The demo's traces, made once, and the page `divergence report --confirm` writes of them."""
    from divergence.cli.common import default_model_dirs
    from divergence.cli.run_cmd import DEMO_POLICY, DEMO_SPEC_K
    from divergence.prompts import builtin_requests
    from divergence.runner import RunConfig, load_models, run_schedules

    target_dir, draft_dir = default_model_dirs()
    cfg = RunConfig(model=target_dir, draft=draft_dir, policy=DEMO_POLICY, spec_k=DEMO_SPEC_K, stop_at_eos=False)
    target, draft = load_models(cfg)
    out = tmp_path_factory.mktemp("demo")
    run_schedules(cfg, target, draft, builtin_requests(target.encode), ["serial", "concurrent"], out)
    a, b, page = out / "serial.h5", out / "concurrent.h5", out / "report.html"
    assert main(["report", str(a), str(b), "--html", str(page), "--confirm"]) == 0
    return a, b, page


def chromium(*args, tmp_path) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_demo_page_is_small_and_names_no_web_resource(demo_page):
    html = demo_page[2].read_text(encoding="utf-8")
    assert len(html.encode()) < 1_000_000
    assert not re.search(r"https?://", html, re.I)
    assert "root cause: cache contamination" in html and "confirmed by replay" in html


def test_bitwise_page_gives_every_logit_drift_its_plots_and_cause(demo_page):
    """With --bitwise, r2-r4 (same tokens, other logits) are diverged too: each gets its cause,
    a margin plot with the first numeric difference and no flip, and a KV grid."""
    from divergence.analysis.bisect import bisect_traces
    from divergence.analysis.html import render_html
    from divergence.trace.reader import Trace

    a, b, _ = demo_page
    with Trace.open(a) as ta, Trace.open(b) as tb:
        rep = bisect_traces(ta, tb, bitwise=True)
        html = render_html(rep, ta, tb)
    drift = [r for r in rep.diff.requests if r.first_divergent_token is None and r.first_numeric_divergence]
    assert drift and all(r.id in rep.causes for r in drift)
    assert html.count("class='figure margin-plot'") == len(rep.causes) == html.count("class='figure kv-grid'")
    cards = {m.group(1): m.group(0) for m in re.finditer(r"id='request-([^']+)'.*?(?=<div class='card|<h2)", html, re.S)}
    for r in drift:
        card = cards[r.id]
        assert f">(position {r.first_numeric_divergence.position})</text>" in card and "<mark" not in card
        assert f"id='cause-{r.id}'" in html


@needs_chromium
def test_demo_page_renders_in_headless_chromium(demo_page, tmp_path):
    from divergence.analysis.bisect import bisect_traces
    from divergence.trace.reader import Trace

    a, b, page = demo_page
    url = page.resolve().as_uri()
    dom = chromium("--dump-dom", url, tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = dom.stdout
    # the root-cause text the CLI prints, as the browser parsed it
    with Trace.open(a) as ta, Trace.open(b) as tb:
        cause = next(iter(bisect_traces(ta, tb).causes.values()))
    assert "root cause: cache contamination" in parsed
    assert f"written in concurrent step {cause.b.step}" in parsed
    # the plots are SVG elements of the DOM, with their marks
    m = re.search(r'<div class="figure margin-plot"><svg\b.*?</svg>', parsed, re.S)
    assert m and ">first numeric difference</text>" in m.group(0) and ">flip</text>" in m.group(0)
    assert re.search(r'<div class="figure kv-grid"><svg\b', parsed)
    assert re.search(r'<div class="figure timeline-plot"><svg\b', parsed)

    shot = tmp_path / "page.png"
    res = chromium(f"--screenshot={shot}", "--window-size=1280,2400", url, tmp_path=tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    from PIL import Image

    im = Image.open(shot).convert("RGB")
    assert im.size == (1280, 2400)
    small = im.resize((320, 600))
    colors = small.getcolors(maxcolors=320 * 600)
    background = max(colors)[1]
    ink = sum(n for n, c in colors if c != background) / (320 * 600)
    # a blank (or error) page is one colour; this one has text, tables and plots
    assert len(colors) > 200 and ink > 0.15, (len(colors), ink)


def test_browser_and_page_count_the_same_kv_cells_the_divergent_step_read(demo_page):
    """One function (analysis.kv_grid) decides which cells the divergent step read; the KV screen's
    title and the page's heat map give the same "N of M cells differ" for the demo's r1."""
    import asyncio

    from divergence.analysis.kv_grid import divergent_read
    from divergence.trace.reader import Trace
    from divergence.tui.app import BrowseApp
    from divergence.tui.data import BrowseData
    from divergence.tui.screens.kv import KvScreen

    a, b, page = demo_page
    html = page.read_text(encoding="utf-8")
    counts = re.findall(r"(\d+) of (\d+) cells differ", html)
    assert len(counts) == 1, counts  # one diverged request: r1
    on_page = tuple(map(int, counts[0]))

    data = BrowseData.open(a, b)
    try:
        data.analyse()
        rid = next(r.id for r in data.request_rows() if r.diverged)
        grid = data.kv_grid(rid, data.kv_default_steps(rid))
        assert grid.read_count() == on_page
        # the grid shows more positions than the step read (its own verify rows' writes, ...):
        # counting all of them is what made the two disagree
        assert len(grid.positions) > grid.read_before
        d = data.request_diff(rid).first_divergent_token
        with Trace.open(a) as ta, Trace.open(b) as tb:
            assert divergent_read(ta, tb, rid, d.position, d.step_a, d.step_b).read_count(None) == on_page

        async def title() -> str:
            app = BrowseApp(data, analyse=False)
            async with app.run_test(size=(160, 48)) as pilot:
                app.current_request = rid
                await pilot.press("k")
                for _ in range(50):
                    await pilot.pause(0.05)
                    await app.workers.wait_for_complete()
                    if isinstance(app.screen, KvScreen) and app.screen.grid is not None:
                        break
                return str(app.screen.query_one("#kv-title").content)

        assert f"{on_page[0]} of {on_page[1]} cells differ" in asyncio.run(title())
    finally:
        data.close()

"""The demo pair's HTML page (`divergence run` on the embedded models, then `divergence
report --confirm`) in a real browser: headless Chromium, offline, from file://. The DOM
it parsed holds the root-cause text and the plots as SVG, the screenshot is not blank,
and the file names no http(s) resource."""
from __future__ import annotations

import json
import os
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
    from divergence.workloads.prompts import builtin_requests
    from divergence.workloads.runner import RunConfig, load_models, run_schedules

    target_dir, draft_dir = default_model_dirs()
    cfg = RunConfig(model=target_dir, draft=draft_dir, policy=DEMO_POLICY, spec_k=DEMO_SPEC_K, stop_at_eos=False)
    target, draft = load_models(cfg)
    out = tmp_path_factory.mktemp("demo")
    run_schedules(cfg, target, draft, builtin_requests(target.encode), ["serial", "concurrent"], out)
    a, b, page = out / "serial.h5", out / "concurrent.h5", out / "report.html"
    assert main(["report", str(a), str(b), "--html", str(page), "--confirm"]) == 1
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


def test_logit_drift_has_its_own_status_on_the_page(demo_page):
    """r2-r4 have the same tokens and other logits: the CLI says "tokens identical; logits differ",
    and the page says so too, not a green "identical"."""
    html = demo_page[2].read_text(encoding="utf-8")
    cards = {m.group(1): m.group(0) for m in re.finditer(r"id='request-([^']+)'.*?(?=<div class='card|<h2)", html, re.S)}
    for rid in ("r2", "r3", "r4"):
        card = cards[rid]
        assert card.startswith(f"id='request-{rid}'") and "identical tokens, logits differ" in card
        assert "<span class='status identical'>" not in card
    assert "3 more with identical tokens but other logits (r2, r3, r4)" in html
    assert "\\u0394" not in html


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
        assert f">first numeric difference (position {r.first_numeric_divergence.position})</text>" in card
        assert "<mark" not in card
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
    assert m and ">first numeric difference (position " in m.group(0) and ">flip (position 127)</text>" in m.group(0)
    assert re.search(r'<div class="figure kv-grid"><svg\b', parsed)
    assert re.search(r'<div class="figure timeline-plot"><svg\b', parsed)

    shot = tmp_path / "page.png"
    res = chromium(f"--screenshot={shot}", "--window-size=1400,2400", url, tmp_path=tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    from PIL import Image

    im = Image.open(shot).convert("RGB")
    assert im.size == (1400, 2400)
    if os.environ.get("DIVERGENCE_REPORT_PNG"):  # how docs/report.png is made: this render, kept
        shutil.copyfile(shot, os.environ["DIVERGENCE_REPORT_PNG"])
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


# Appended to a copy of the page (the page itself has no script): measures, as the browser laid it
# out, what sticks out of the viewport (scroll boxes hold what is wider: they scroll on their own),
# how large the plots' text is drawn, and whether the marked divergent token is in view (not hidden
# in a box of its own scroll).
PROBE = """<script>
(() => {
  const vw = document.documentElement.clientWidth, out = [];
  const scrolls = el => { for (let p = el.parentElement; p; p = p.parentElement) {
      const o = getComputedStyle(p).overflowX; if (o === 'auto' || o === 'scroll' || o === 'hidden') return true; }
    return false; };
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width && (r.right > vw + 1 || r.left < -1) && !scrolls(el)) out.push(el.tagName + '.' + el.className + ' ' + Math.round(r.left) + '..' + Math.round(r.right));
  }
  const plots = [...document.querySelectorAll('.figure svg')].map(s => {
    const t = s.querySelector('text'); return t ? t.getBoundingClientRect().height : 0; });
  const marks = [...document.querySelectorAll('mark.flip')].map(m => {
    const r = m.getBoundingClientRect();
    for (let p = m.parentElement; p; p = p.parentElement) {
      const b = p.getBoundingClientRect();
      if (getComputedStyle(p).overflowY !== 'visible' && (r.top < b.top || r.bottom > b.bottom)) return false; }
    return true; });
  const pre = parent.document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify({viewport: vw, doc: document.documentElement.scrollWidth, out, plots, marks});
  parent.document.body.appendChild(pre);
})();
</script>"""


@needs_chromium
@pytest.mark.parametrize("width", [390, 1400])
def test_demo_page_fits_a_phone_and_a_desktop(demo_page, tmp_path, width):
    """At a phone's 390 px and a desktop's 1400 px: nothing runs off the page sideways (wide tables
    and plots scroll in their own box), the plots' text stays readable, and every marked first
    divergent token is on the page, not scrolled away inside its text box."""
    import html as H

    page = demo_page[2]
    probed = page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>")
    # a frame of exactly that width (a headless window is never narrower than 500 px); srcdoc: the
    # frame shares the wrapper's origin, so the probe can write its result where --dump-dom sees it
    probe = tmp_path / "probe.html"
    probe.write_text(f"<!DOCTYPE html><html><body style='margin:0'><iframe style='border:0;width:{width}px;"
                     f"height:1200px' srcdoc=\"{H.escape(probed, quote=True)}\"></iframe></body></html>",
                     encoding="utf-8")
    dom = chromium("--dump-dom", f"--window-size={width + 100},1300", probe.resolve().as_uri(), tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert m, dom.stdout[-2000:]
    r = json.loads(H.unescape(m.group(1)))
    assert r["viewport"] == width and r["doc"] <= r["viewport"], r
    assert not r["out"], r["out"][:10]
    assert r["plots"] and min(r["plots"]) >= 7, r["plots"]  # px of a plot's text line, as drawn
    assert r["marks"] and all(r["marks"]), r["marks"]
    shot = tmp_path / "page.png"
    res = chromium(f"--screenshot={shot}", f"--window-size={width},1600", page.resolve().as_uri(), tmp_path=tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]

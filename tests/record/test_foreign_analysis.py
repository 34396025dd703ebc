"""Imported traces go through everything that reads traces exactly as the engine's own:
the pytest assertion, the HTML report, the browser."""
from __future__ import annotations

import pytest

from divergence.cli.main import main
from divergence.testing import assert_traces_equal
from divergence.tui.app import BrowseApp
from divergence.tui.data import B, BrowseData


def test_the_assertion_fails_with_the_bisect_report(pair):
    assert_traces_equal(pair[0], pair[0])
    with pytest.raises(AssertionError) as e:
        assert_traces_equal(*pair)
    text = str(e.value)
    assert "r1" in text and "cache contamination" in text and "step 3" in text and "mm/4" in text, text
    assert e.value.report.causes["r1"].b.step == 3


def test_report_page(pair, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(pair[0]), str(pair[1]), "--html", str(out)]) == 1  # diverged; the page is written
    page = out.read_text()
    assert "mm/4" in page and "toy-engine" in page


def test_browse_data_and_app(pair):
    data = BrowseData.open(*pair)
    try:
        data.analyse()
        rows = {r.id: r for r in data.request_rows()}
        assert rows["r1"].diverged and rows["r1"].cause.b.step == 3 and not rows["r2"].diverged
        idx = data.steps(B)
        idx.load_kernels()
        det = data.step_detail(B, idx.row_of_step(3))
        assert {k.op for k in det.kernels} >= {"attn.k", "lm_head"}
        assert [(m.request_id, m.root) for m in det.marks] == [("r1", True)]
        assert data.kv_grid("r1", data.kv_default_steps("r1")).earliest == (0, 10)
    finally:
        data.close()


@pytest.mark.anyio
async def test_every_screen_opens_on_an_imported_pair(pair):
    from tests.tui.helpers import screen_text, settle

    data = BrowseData.open(*pair)
    app = BrowseApp(data)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            assert "r1" in screen_text(app)
            for k in ["d", "enter", "d", "f", "b", "end", "a", "enter", "k", "e", "b", "o", "t", "s", "enter"]:
                await pilot.press(k)
            await settle(pilot)
            assert app.is_running
    finally:
        data.close()

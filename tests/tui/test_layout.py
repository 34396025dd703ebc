"""The layout at a laptop's 80x24 and a large 160x48: the table first, nothing cut that fits."""
from __future__ import annotations

import re

import pytest

from divergence.tui.app import BrowseApp
from divergence.tui.data import B, BrowseData
from divergence.tui.screens.help import HelpScreen
from divergence.tui.screens.steps import StepScreen
from divergence.tui.screens.tokens import TokenScreen
from divergence.tui.widgets.virtual_table import VirtualTable

from .helpers import screen_text, settle, text_of

pytestmark = pytest.mark.anyio



def visible(table: VirtualTable) -> range:
    top = round(table.scroll_y)
    return range(top, top + table.page_rows)


async def test_80x24_overview_shows_the_table_and_m_toggles_the_settings(app):
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        ov = app.screen
        table = ov.query_one("#requests", VirtualTable)
        assert not ov.query_one("#overview-meta").display
        assert table.size.height >= 4 and len(visible(table)) >= len(ov.rows)  # every request on screen
        text = screen_text(app)
        assert all(re.search(rf"^{r.id}\s", text, re.M) for r in ov.rows)
        assert "diverged at 14 (#8)" in text and "m run settings · A serial vs B concurrent" in text
        await pilot.press("m")
        await settle(pilot)
        assert ov.query_one("#overview-meta").display and "threshold:4" in screen_text(app)
        await pilot.press("m")
        await settle(pilot)
        assert not ov.query_one("#overview-meta").display
        await pilot.press("question_mark")
        await settle(pilot)
        assert isinstance(app.screen, HelpScreen)
        assert re.search(r"^\s*m\s+run settings", text_of(app.screen.query_one("#help-text")), re.M)


async def test_160x48_overview_shows_the_settings_whole(app):
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        ov = app.screen
        assert ov.query_one("#overview-meta").display
        text = screen_text(app)
        assert "netlib (bundled)" in text and "…" not in text.split("────")[0]


async def test_80x24_token_screen_keeps_the_token_table(app):
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("enter")
        await settle(pilot)
        ts = app.screen
        assert isinstance(ts, TokenScreen)
        assert ts.table.page_rows >= 6 and ts.table.cursor in visible(ts.table)
        text = screen_text(app)
        assert "▶     14" in text  # the first divergent token's row, with its mark
        topk = ts.query_one("#topk")
        assert topk.region.bottom <= app.size.height - 1  # the whole panel is above the footer
        assert "r1 · position 14 (generated #8) · top-k" in text and "chose 48" in text


async def test_enter_scrolls_the_cursor_into_view_without_a_key(long_pair):
    """The token table opens on the first divergent token (row 60,000 of 100,000) in view."""
    data = BrowseData.open(*long_pair)
    try:
        app = BrowseApp(data)
        async with app.run_test(size=(160, 48)) as pilot:
            await settle(pilot)
            await pilot.press("enter")
            await settle(pilot)
            ts = app.screen
            assert isinstance(ts, TokenScreen) and ts.table.cursor == ts.al.first_divergent > 50_000
            assert ts.table.cursor in visible(ts.table)
            assert re.search(rf"^▶\s+{ts.cursor_position}\s", screen_text(app), re.M)
    finally:
        data.close()


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_step_timeline_kernel_columns_hold_their_labels(app, size):
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await settle(pilot)
        st = app.screen
        assert isinstance(st, StepScreen)
        idx = app.data.steps(B)
        labels = {n: {(idx.kernel_summary(i) or {}).get(n, "") for i in range(len(idx))} for n in ("attn", "mlp")}
        cols = {c.label: c.width for c in st.table.columns}
        for name, texts in labels.items():
            assert cols[name] >= max(map(len, texts)), (name, cols[name], texts)
        title = text_of(st.query_one("#steps-title"), width=size[0] - 2).rstrip("\n").splitlines()
        assert len(title) == (2 if size[0] < 100 else 1), title
        assert "step 3: root cause of r1" in title[-1]
        text = screen_text(app)
        assert "r2 prefill[0:40] + r1 decode[8:9]" in text  # the root-cause step's composition, whole
        assert st.table.cursor in visible(st.table)

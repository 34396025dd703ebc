"""A pair of 100,000-token traces (100,000 steps each) opens in under a second and stays responsive:
rows are rendered only when they scroll into view."""
from __future__ import annotations

from time import perf_counter, thread_time

import pytest

from divergence.tui.app import BrowseApp
from divergence.tui.data import B, BrowseData
from divergence.tui.screens.kv import KvScreen
from divergence.tui.screens.steps import StepScreen
from divergence.tui.screens.tokens import TokenScreen

from .helpers import settle

pytestmark = pytest.mark.anyio
N = 100_000


async def test_100k_token_pair_opens_in_under_a_second(long_pair):
    """Open to the overview's first paint: under a second of the UI thread's CPU time (wall time
    on a loaded test machine says little; it is printed, and bounded loosely)."""
    painted = {}

    class Timed(BrowseApp):
        def on_mount(self) -> None:  # BrowseApp.on_mount runs too (textual calls every class's handler)
            self.call_after_refresh(lambda: painted.setdefault("overview", (perf_counter(), thread_time())))

    t0, c0 = perf_counter(), thread_time()
    data = BrowseData.open(*long_pair)
    try:
        app = Timed(data)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            wall, cpu = painted["overview"][0] - t0, painted["overview"][1] - c0
            print(f"\n100k-token pair: overview painted {wall:.3f} s after open ({cpu:.3f} s CPU of the UI thread)")
            assert cpu < 1.0 and wall < 3.0
            ov = app.screen
            assert ov.rows[0].len_a == ov.rows[0].len_b == N
            await settle(pilot)
            assert ov.rows[0].diverged

            t = perf_counter()
            await pilot.press("enter")
            await settle(pilot)
            ts = app.screen
            print(f"token view of 100k tokens: {perf_counter() - t:.3f} s")
            assert isinstance(ts, TokenScreen) and ts.cursor_position == 60_001
            rendered = []
            render = ts.table.render_row
            ts.table.render_row = lambda i: rendered.append(i) or render(i)
            await pilot.press("end")
            assert ts.cursor_position == N + 3
            await pilot.press("home", "pagedown")
            assert 0 < len(rendered) < 200  # only what was on screen

            t = perf_counter()
            await pilot.press("enter")  # B's step that produced the token
            await settle(pilot)
            st = app.screen
            print(f"step timeline of 100k steps: {perf_counter() - t:.3f} s")
            assert isinstance(st, StepScreen) and len(data.steps(B)) == N
            await pilot.press("end")
            assert int(data.steps(B).index[st.table.cursor]) == N - 1
            assert "lm_head" in str(st.query_one("#step-detail").content)

            await pilot.press("k")
            await settle(pilot)
            kv = app.screen
            assert isinstance(kv, KvScreen) and len(kv.grid.positions) > 59_000
            await pilot.press("end")
            assert kv.view.cursor[1] == len(kv.grid.positions) - 1
    finally:
        data.close()

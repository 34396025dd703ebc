"""Drive the real app with Pilot over the story pair: from the overview to the root-cause step."""
from __future__ import annotations

import numpy as np
import pytest

from divergence.trace.reader import Trace
from divergence.tui.app import BrowseApp
from divergence.tui.data import A, B, BrowseData, fmt_logit
from divergence.tui.screens.help import HelpScreen
from divergence.tui.screens.kv import KvScreen
from divergence.tui.screens.overview import OverviewScreen
from divergence.tui.screens.steps import StepScreen
from divergence.tui.screens.tokens import TokenScreen
from divergence.tui.widgets.kv_grid import KvGridView
from divergence.tui.widgets.topk import TopKPanel
from divergence.tui.widgets.virtual_table import VirtualTable

from .helpers import screen_text, settle, text_of

SIZE = (120, 40)
pytestmark = pytest.mark.anyio



async def test_from_overview_to_the_root_cause(app, story_pair):
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        ov = app.screen
        assert isinstance(ov, OverviewScreen)
        text = screen_text(app)
        assert "diverged at 14 (#8)" in text and "cache contamination L0 @ step 3" in text
        # from r2, `d` finds the next diverged request (wrapping to r1)
        await pilot.press("down")
        assert app.current_request == "r2"
        await pilot.press("d")
        assert app.current_request == "r1"
        detail = text_of(ov.query_one("#request-detail"))
        assert "root cause: cache contamination, layer 0" in detail and "concurrent step 3" in detail

        # enter: the token view opens on the first divergent token
        await pilot.press("enter")
        await settle(pilot)
        ts = app.screen
        assert isinstance(ts, TokenScreen) and ts.request_id == "r1"
        assert ts.cursor_position == 14
        # select the first numeric divergence, then the divergent token again
        await pilot.press("f")
        assert ts.cursor_position == 10
        await pilot.press("d")
        assert ts.cursor_position == 14

        # both top-k tables hold the trace's exact values
        panel = ts.query_one("#topk", TopKPanel)
        shown = text_of(panel)
        for side, path in zip(panel.topk.sides, story_pair):
            with Trace.open(path) as t:
                rec = t.tokens("r1")
                i = int(np.flatnonzero(rec.positions == 14)[0])
                assert side.ids == rec.topk_ids[i].tolist()
                assert np.array_equal(np.float32(side.logits).view(np.uint32), rec.topk_logits[i].view(np.uint32))
                for x in rec.topk_logits[i]:
                    assert fmt_logit(x) in shown
        assert "A serial · step 8 · chose 30" in shown and "B concurrent · step 8 · chose 48" in shown

        # enter: B's step that produced the token
        await pilot.press("enter")
        await settle(pilot)
        st = app.screen
        assert isinstance(st, StepScreen) and st.side == B
        table = st.query_one("#steps", VirtualTable)
        assert int(app.data.steps(B).index[table.cursor]) == 8
        # d: the root-cause step, highlighted, with its kernels
        await pilot.press("d")
        assert int(app.data.steps(B).index[table.cursor]) == 3
        detail = text_of(st.query_one("#step-detail"))
        assert "root cause of r1" in detail and "gemm/4" in detail and "41 rows" in detail
        assert table.render_row(table.cursor)[1] == "bold white on dark_red"
        # the same step in A's timeline
        await pilot.press("a")
        assert st.side == A and int(app.data.steps(A).index[table.cursor]) == 3
        assert "gemv" in text_of(st.query_one("#step-detail"))

        # esc walks back: steps -> tokens -> overview
        await pilot.press("escape")
        assert isinstance(app.screen, TokenScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, OverviewScreen)


async def test_kv_view_and_jump_to_the_writer(app):
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("k")
        await settle(pilot)
        kv = app.screen
        assert isinstance(kv, KvScreen) and kv.request_id == "r1"
        view = kv.query_one("#kv", KvGridView)
        assert view.cursor == (0, 8) == kv.grid.earliest
        assert "earliest: layer 0 position 8, written by B step 3" in text_of(kv.query_one("#kv-title"))
        assert "◆" in screen_text(app)
        await pilot.press("left", "left")
        assert view.cursor == (0, 6)
        await pilot.press("d")
        assert view.cursor == (0, 8)
        # e: the live writes at the end of the run (more cells differ after the flip)
        assert kv.grid.at_steps == (8, 8)  # the steps that computed the divergent token
        at_divergence = kv.grid.num_differ
        await pilot.press("e")
        await settle(pilot)
        assert kv.grid.at_steps == (None, None) and kv.grid.num_differ > at_divergence
        await pilot.press("d", "b")
        await settle(pilot)
        st = app.screen
        assert isinstance(st, StepScreen) and st.side == B
        assert int(app.data.steps(B).index[st.query_one("#steps", VirtualTable).cursor]) == 3


async def test_go_to_search_and_help(app):
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("enter")
        await settle(pilot)
        ts = app.screen
        await pilot.press("g", "2", "0", "enter")  # the prompt, typed
        assert ts.cursor_position == 20
        assert ts.goto("#2") is None and ts.cursor_position == 8  # the N-th generated token
        assert "no generated token" in ts.goto("999") and ts.cursor_position == 8
        assert ts.search("values") is None
        found = ts.table.cursor
        assert any("values" in (app.data.piece(int(ts.al.tokens[s, found])) or "") for s in (A, B))
        await pilot.press("n")
        assert ts.table.cursor != found
        await pilot.press("s")
        await settle(pilot)
        st = app.screen
        assert st.goto("12") is None and int(app.data.steps(B).index[st.table.cursor]) == 12
        await pilot.press("slash", "r", "3", "enter")  # the search prompt, typed
        assert "r3" in app.data.steps(B).row(st.table.cursor).requests
        assert "no request" in st.search("r9")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = text_of(app.screen.query_one("#help-text"))
        assert "first divergent" in help_text and "root cause" in help_text
        await pilot.press("escape")
        assert isinstance(app.screen, StepScreen)
        await pilot.press("o")
        await pilot.pause()
        assert isinstance(app.screen, OverviewScreen) and len(app.screen_stack) == 1
        table = app.screen.query_one("#requests", VirtualTable)
        await pilot.click(table, offset=(2, 3))  # the header is line 0: line 3 is r3
        assert table.cursor == 2 and app.current_request == "r3"


async def test_one_trace(story_pair):
    data = BrowseData.open(story_pair[1])
    app = BrowseApp(data)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            text = screen_text(app)
            assert "B concurrent" not in text and "diverged" not in text
            await pilot.press("enter")
            await settle(pilot)
            ts = app.screen
            assert isinstance(ts, TokenScreen) and ts.cursor_position == 6
            assert len(ts.query_one("#topk", TopKPanel).topk.sides) == 1
            await pilot.press("b")  # no B: nothing happens
            assert app.screen is ts
            await pilot.press("a")
            await settle(pilot)
            assert isinstance(app.screen, StepScreen) and app.screen.side == A
            await pilot.press("k")
            await settle(pilot)
            assert isinstance(app.screen, KvScreen) and app.screen.grid.earliest is None
    finally:
        data.close()


async def test_traces_without_kv_hashes(tmp_path):
    from . import story

    a = story.write_run(tmp_path / "serial.h5", "serial", kv_hashes=False)
    b = story.write_run(tmp_path / "concurrent.h5", "concurrent", kv_hashes=False)
    data = BrowseData.open(a, b)
    app = BrowseApp(data)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert app.screen.rows[0].diverged
            await pilot.press("k")
            await settle(pilot)
            kv = app.screen
            assert isinstance(kv, KvScreen) and not len(kv.grid.positions)
            assert "no KV writes recorded" in text_of(kv.query_one("#kv-title"))
            await pilot.press("d", "b", "right")  # nothing to go to; nothing breaks
            assert app.screen is kv
    finally:
        data.close()


KEYS = {("serial", "killed"): ["d", "enter", "d", "f", "b", "end", "d", "a", "enter", "k", "d", "e", "b", "o"],
        ("empty",): ["enter", "t", "s", "enter", "k", "b"]}


@pytest.mark.parametrize("names", list(KEYS))
async def test_every_key_on_incomplete_traces(tmp_path, names):
    """A killed run's trace (cut after 6 steps, or before any) opens, and no key breaks the app."""
    from . import story

    how = {"serial": ("serial", None), "killed": ("concurrent", 6), "empty": ("concurrent", 0)}
    paths = [story.write_run(tmp_path / f"{n}.h5", how[n][0], stop_after=how[n][1]) for n in names]
    data = BrowseData.open(*paths)
    app = BrowseApp(data)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            if "killed" in names or "empty" in names:
                assert "NO (killed or still running)" in screen_text(app)
            for k in KEYS[names]:
                await pilot.press(k)
            await settle(pilot)
            assert app.is_running
    finally:
        data.close()

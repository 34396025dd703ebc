"""The browser over traces of the real pipeline (`divergence run`'s API on the embedded fixture models)."""
from __future__ import annotations

import numpy as np
import pytest

from divergence.analysis.bisect import bisect_traces
from divergence.trace.reader import Trace
from divergence.tui.app import BrowseApp
from divergence.tui.data import B, BrowseData
from divergence.tui.screens.steps import StepScreen
from divergence.tui.screens.tokens import TokenScreen

from .helpers import settle

pytestmark = pytest.mark.anyio


async def check_pair(path_a, path_b) -> None:
    """Every diverged request: its first divergent token, both top-k lists exact, its root-cause step."""
    with Trace.open(path_a) as a, Trace.open(path_b) as b:
        report = bisect_traces(a, b)
        expected = {r.id: r for r in report.diff.requests}
        stored = {s: {r: t.tokens(r) for r in expected} for s, t in enumerate((a, b))}
    data = BrowseData.open(path_a, path_b)
    try:
        app = BrowseApp(data)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            ov = app.screen
            assert [r.id for r in ov.rows] == list(expected)
            assert [r.status for r in ov.rows] == [r.status for r in expected.values()]
            diverged = [i for i, r in enumerate(ov.rows) if expected[r.id].first_divergent_token is not None]
            for i in diverged or [0]:  # an identical pair: still check one request's tokens
                row = ov.rows[i]
                want = expected[row.id]
                ov.query_one("#requests").move_cursor(i)
                await pilot.press("enter")
                await settle(pilot)
                ts = app.screen
                assert isinstance(ts, TokenScreen) and ts.request_id == row.id
                first = want.first_divergent_token or want.first_numeric_divergence
                assert ts.cursor_position == (first.position if first else int(stored[0][row.id].positions[0]))
                tk = ts.query_one("#topk").topk
                for s, side in enumerate(tk.sides):
                    rec = stored[s][row.id]
                    j = int(np.flatnonzero(rec.positions == tk.position)[0])
                    assert side.ids == [x for x in rec.topk_ids[j].tolist() if x >= 0]
                    assert np.array_equal(np.float32(side.logits).view(np.uint32),
                                          rec.topk_logits[j][: len(side.ids)].view(np.uint32))
                cause = report.causes.get(row.id)
                if cause is not None:
                    await pilot.press("s")
                    await settle(pilot)
                    st = app.screen
                    assert isinstance(st, StepScreen) and st.side == B
                    assert int(data.steps(B).index[st.table.cursor]) == cause.b.step
                await pilot.press("o")
                await settle(pilot)
    finally:
        data.close()


async def test_real_pipeline(real_pair):
    await check_pair(*real_pair)

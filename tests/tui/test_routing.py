"""browse shows a position's MoE routing: both sides' experts and gate values per
layer under the token cursor, flipped layers marked (a planted router near-tie)."""
from __future__ import annotations

import pytest

from divergence.tui.app import BrowseApp
from divergence.tui.data import BrowseData
from divergence.tui.screens.tokens import TokenScreen
from divergence.tui.widgets.routing import RoutingPanel

from .helpers import settle, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.blas]  # the planted tie flips at this core's rounding


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """Serial mixtral trace with a router at layer 0 near-tied closely enough to flip on this
    backend's kernels, and its replay with the router on gemm (divergence.testing.near_tie)."""
    from divergence.testing.near_tie import planted_router_pair

    return planted_router_pair(tmp_path_factory.mktemp("moe"), 0, ["Return the number of",
                               "The socket module provides"], hidden_size=64, num_layers=2, num_experts=8,
                               experts_per_token=2, dtype="float32")


def _flips(data):
    out = []
    for rid in data.request_ids:
        prompt = len(data.prompt(rid))
        for p in range(prompt, prompt + 31):
            r = data.routing(rid, p)
            out += [(rid, p, row) for row in r.layers if row.flipped]
    return out


async def test_token_view_shows_the_routing_of_a_position(moe_pair):
    data = BrowseData.open(*moe_pair)
    try:
        flips = _flips(data)
        assert flips, "the planted near-tie should flip some generated position's routing"
        rid, pos, row = flips[0]
        assert row.layer == 0 and row.same_input  # layer 0's router saw the same input: its kernel did it
        async with BrowseApp(data).run_test(size=(140, 60)) as pilot:
            await settle(pilot)
            app = pilot.app
            app.push_screen(TokenScreen(rid, pos))
            await settle(pilot)
            ts = app.screen
            assert ts.cursor_position == pos
            text = text_of(ts.query_one("#routing", RoutingPanel), width=140)
            assert f"routing of position {pos}" in text and "≠ layer 0" in text
            assert "same router input: the gate's kernel" in text
            for s in row.sides:
                assert f"step {s.step}: " in text
                assert all(f"{e} {v:.9g}" in text for e, v in zip(s.experts, s.scores))
    finally:
        data.close()


def test_dense_traces_have_no_routing(story_pair):
    data = BrowseData.open(*story_pair)
    try:
        assert data.routing(data.request_ids[0], 3) is None
    finally:
        data.close()

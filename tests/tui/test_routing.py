"""browse shows a position's MoE routing: both sides' experts and gate values per
layer under the token cursor, flipped layers marked (a planted router near-tie)."""
from __future__ import annotations

import pytest

from divergence.analysis.replay import Replayer, parse_force
from divergence.core.request import Request
from divergence.engine.model import load_model
from divergence.runner import RunConfig, run_schedules
from divergence.testing.models import make_random_model
from divergence.trace.reader import Trace
from divergence.tui.app import BrowseApp
from divergence.tui.data import BrowseData
from divergence.tui.screens.tokens import TokenScreen
from divergence.tui.widgets.routing import RoutingPanel

from .helpers import settle, text_of

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """Serial mixtral trace with a near-tied router at layer 0, and its replay with the router on gemm."""
    d = tmp_path_factory.mktemp("moe")
    loaded = load_model(make_random_model(d / "m", model_type="mixtral", hidden_size=64, num_layers=2,
                                          num_experts=8, experts_per_token=2, dtype="float32",
                                          planted_tie=(0, 1e-6)))
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=32)
            for i, p in enumerate(["Return the number of", "The socket module provides"])]
    run_schedules(RunConfig(model=loaded.path), loaded, None, reqs, ["serial"], d)
    with Trace.open(d / "serial.h5") as a:
        forced = parse_force([f"{int(s)}:gate=gemm:2" for s in a.steps["index"]])
        Replayer().replay_to_file(a, d / "gate.h5", forced=forced)
    return d / "serial.h5", d / "gate.h5"


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

"""SVG snapshots of each screen over the story pair, at a fixed terminal size.

The traces are synthetic and their creation time fixed, and no screen shows a
clock, so every run renders the same. After a deliberate change of the look:
    pytest tests/tui/test_snapshots.py --snapshot-update
"""
from __future__ import annotations

import pytest

from divergence.tui.app import BrowseApp
from divergence.tui.data import BrowseData

from .helpers import settle

SIZE = (110, 36)


@pytest.fixture
def make_app():
    opened = []

    def make(*paths):
        data = BrowseData.open(*paths)
        opened.append(data)
        return BrowseApp(data)

    yield make
    for d in opened:
        d.close()


def keys(*pressed):
    async def run(pilot):
        await settle(pilot)
        for k in pressed:
            await pilot.press(k)
            await settle(pilot)
    return run


def test_overview(snap_compare, make_app, story_pair):
    assert snap_compare(make_app(*story_pair), terminal_size=SIZE, run_before=keys())


def test_tokens_at_the_divergent_token(snap_compare, make_app, story_pair):
    assert snap_compare(make_app(*story_pair), terminal_size=SIZE, run_before=keys("enter"))


def test_steps_at_the_root_cause(snap_compare, make_app, story_pair):
    assert snap_compare(make_app(*story_pair), terminal_size=SIZE, run_before=keys("s"))


def test_kv_grid(snap_compare, make_app, story_pair):
    assert snap_compare(make_app(*story_pair), terminal_size=SIZE, run_before=keys("k"))


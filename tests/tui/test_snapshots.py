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
# a laptop's default terminal and a large one: the table comes first at both
SIZES = {"80x24": (80, 24), "160x48": (160, 48)}


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



SCREENS = {"overview": (), "tokens": ("enter",), "steps": ("s",), "kv": ("k",)}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("screen", SCREENS)
def test_screen_at_size(snap_compare, make_app, story_pair, screen, size):
    assert snap_compare(make_app(*story_pair), terminal_size=SIZES[size], run_before=keys(*SCREENS[screen]))


def test_overview_with_run_settings_shown_at_80x24(snap_compare, make_app, story_pair):
    assert snap_compare(make_app(*story_pair), terminal_size=SIZES["80x24"], run_before=keys("m"))

"""Traces for the browser's tests: a synthetic story pair (deterministic, for snapshots),
a long pair (100,000 tokens), and the real pipeline's pair when the fixture models exist."""
from __future__ import annotations

import pytest

from . import story


@pytest.fixture(scope="session")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def story_pair(tmp_path_factory):
    """(serial.h5, concurrent.h5): r1 contaminated by B step 3, flips at position 14."""
    return story.write_pair(tmp_path_factory.mktemp("story"))


@pytest.fixture(scope="session")
def other_model_trace(tmp_path_factory):
    """The same requests, recorded with another model (weights hash)."""
    d = tmp_path_factory.mktemp("other")
    return story.write_run(d / "concurrent.h5", "concurrent", weights_hash="0ther")


@pytest.fixture(scope="session")
def long_pair(tmp_path_factory):
    """Two traces of one 100,000-token request (100,000 steps each), diverging at position 60,000."""
    d = tmp_path_factory.mktemp("long")
    return (story.write_long(d / "serial.h5", "serial", 100_000),
            story.write_long(d / "concurrent.h5", "concurrent", 100_000, flip_at=60_000))


@pytest.fixture(scope="session")
def real_pair(tmp_path_factory):
    """`divergence run` through its Python API on the embedded fixture models (demo settings)."""
    from divergence.cli.run_cmd import DEMO_POLICY, DEMO_SPEC_K
    from divergence.cli.common import default_model_dirs

    target_dir, draft_dir = default_model_dirs()
    for d in (target_dir, draft_dir):
        if not (d / "config.json").exists() or not any(d.glob("*.safetensors")):
            pytest.skip(f"fixture models not built ({d})")
    from divergence.workloads.prompts import builtin_requests
    from divergence.workloads.runner import RunConfig, load_models, run_schedules

    cfg = RunConfig(model=target_dir, draft=draft_dir, policy=DEMO_POLICY, spec_k=DEMO_SPEC_K)
    target, draft = load_models(cfg)
    out = tmp_path_factory.mktemp("real")
    run_schedules(cfg, target, draft, builtin_requests(target.encode, max_tokens=8), ["serial", "concurrent"], out)
    return out / "serial.h5", out / "concurrent.h5"


@pytest.fixture
def app(story_pair):
    """The browser over the story pair (tests/tui/story.py), closed after the test."""
    from divergence.tui.app import BrowseApp
    from divergence.tui.data import BrowseData

    data = BrowseData.open(*story_pair)
    yield BrowseApp(data)
    data.close()

"""Drive the plugin with pytester, in-process: the engine and the models are
imported and loaded once here (pytester drops modules an inner run imports),
so every inner run reuses them."""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest


# On the fixture model, threshold:1 makes r1 ("This module...") and r3 differ between
# serial and concurrent within 24 tokens (at generated #5 and #20, whatever they are
# batched with); r2 stays equal.
DIVERGING = ["This module provides regular expression", "The socket module provides", "Decode the object using the codec"]
MAX_TOKENS = 24
FEW_TOKENS = 8  # r1 alone diverges; enough for checks that pass or that test plumbing


def plugin_installed() -> bool:
    """True when pytest loads the plugin by itself (divergence installed: the pytest11 entry point)."""
    return any(ep.value == "divergence.testing.plugin" for ep in entry_points(group="pytest11"))


@pytest.fixture(scope="session", autouse=True)
def _engine_imported():
    """Import what a check uses before pytester snapshots sys.modules, and warm the model cache."""
    import divergence.engine.kernels.blas  # noqa: F401  (before MLX)
    import divergence.analysis.bisect  # noqa: F401
    import divergence.analysis.replayer  # noqa: F401
    import divergence.engine.engine  # noqa: F401
    import divergence.testing.plugin  # noqa: F401
    import divergence.trace.reader  # noqa: F401
    import divergence.trace.writer  # noqa: F401
    from divergence.fixtures import TARGET
    from divergence.workloads.runner import RunConfig, load_models

    load_models(RunConfig(model=TARGET))


@pytest.fixture
def header():
    """The first lines of an inner test module: the prompts and max_tokens the tests use."""
    return f"PROMPTS = {DIVERGING!r}\nMAX_TOKENS = {MAX_TOKENS}\nFEW_TOKENS = {FEW_TOKENS}\n"


@pytest.fixture
def run(pytester):
    """run(*args) -> RunResult of an in-process pytest in pytester's folder, with the plugin loaded."""
    extra = [] if plugin_installed() else ["-p", "divergence.testing.plugin"]

    def go(*args):
        # textual-snapshot keeps its temp folder in an environment variable that an inner
        # session would delete under the outer one.
        return pytester.runpytest(*extra, "-p", "no:cacheprovider", "-p", "no:textual-snapshot", *args)

    return go


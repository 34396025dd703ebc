"""pytest plugin (entry point `pytest11: divergence`): options, ini keys, the
`divergence_check` fixture and the `reproducible` marker.

    def test_serving(divergence_check):
        divergence_check(["Return the number of", "If the object"], policy="batch-invariant")

    @pytest.mark.reproducible(prompts=["Return the number of"], policy="batch-invariant")
    def test_marked():
        pass

The logic lives in checker.py / assertions.py; this module imports neither MLX
nor the engine, since pytest loads it in every project of the environment.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from ..errors import DivergenceInputError
from .assertions import SCRATCH
from .checker import ReproducibilityChecker, keep_artifacts, run_marker
from .settings import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_POLICY,
    DEFAULT_TOP_K,
    Settings,
    check_model_dir,
    check_policy,
    check_positive_int,
    parse_bool,
)

SETTINGS = pytest.StashKey[Settings]()
CHECKER = pytest.StashKey[object]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("divergence", "reproducibility checks (divergence)")
    group.addoption("--divergence-artifacts", metavar="DIR", default=None,
                    help="keep both traces of each failing reproducibility check in DIR/<test id>/ "
                         "(for CI to upload)")
    group.addoption("--divergence-confirm", dest="divergence_confirm", action="store_true", default=None,
                    help="confirm each root cause by replay (default: ini divergence_confirm, true)")
    group.addoption("--no-divergence-confirm", dest="divergence_confirm", action="store_false",
                    help="report root causes without replaying them (faster)")
    parser.addini("divergence_model", "model directory for divergence_check / @reproducible "
                  "(default: the embedded fixture model); relative to the ini file", default="")
    parser.addini("divergence_draft", "draft model directory for spec_k > 0 (default: the fixture draft)",
                  default="")
    parser.addini("divergence_policy", "kernel policy: native | batch-invariant | threshold:N",
                  default=DEFAULT_POLICY)
    parser.addini("divergence_top_k", "top-k logits recorded per token", default=str(DEFAULT_TOP_K))
    parser.addini("divergence_max_tokens", "tokens generated per prompt", default=str(DEFAULT_MAX_TOKENS))
    parser.addini("divergence_confirm", "confirm root causes by replay", type="bool", default=True)
    parser.addini("divergence_bitwise", "fail on equal tokens whose logits differ (bit for bit), as "
                  "bitwise=True does per check", type="bool", default=False)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "reproducible(prompts, *, model=None, policy=..., spec_k=0, max_tokens=..., schedules=...): "
        "run the prompts under serial and concurrent schedules; fail with the root cause if they differ")
    try:
        config.stash[SETTINGS] = _settings(config)
    except DivergenceInputError as e:
        raise pytest.UsageError(f"divergence: {e}") from None


def _settings(config) -> Settings:
    base = config.inipath.parent if config.inipath else config.rootpath
    model = config.getini("divergence_model").strip()
    draft = config.getini("divergence_draft").strip()
    artifacts = config.getoption("divergence_artifacts")
    if artifacts:
        artifacts = Path(artifacts).expanduser().absolute()
        if artifacts.exists() and not artifacts.is_dir():
            raise DivergenceInputError(f"--divergence-artifacts {artifacts} exists and is not a directory")
    confirm = config.getoption("divergence_confirm")
    return Settings(
        model=check_model_dir("divergence_model", model, base) if model else None,
        draft=check_model_dir("divergence_draft", draft, base) if draft else None,
        policy=check_policy(config.getini("divergence_policy")),
        top_k=check_positive_int("divergence_top_k", config.getini("divergence_top_k")),
        max_tokens=check_positive_int("divergence_max_tokens", config.getini("divergence_max_tokens")),
        confirm=parse_bool("divergence_confirm", config.getini("divergence_confirm")) if confirm is None else confirm,
        artifacts=artifacts or None,
        bitwise=parse_bool("divergence_bitwise", config.getini("divergence_bitwise")),
    )


def _checker(item):
    if CHECKER not in item.stash:
        settings = item.config.stash[SETTINGS]
        base = settings.artifacts
        if base is None:
            factory = getattr(item.config, "_tmp_path_factory", None)  # pytest's own, as the tmpdir plugin sets it
            base = factory.getbasetemp() / "divergence" if factory else Path(_tempdir()) / "divergence"
        item.stash[CHECKER] = ReproducibilityChecker(settings, item.nodeid, base)
    return item.stash[CHECKER]


def _tempdir() -> str:
    return tempfile.gettempdir()


@pytest.fixture
def divergence_check(request):
    """`divergence_check(prompts, policy=..., spec_k=..., ...)`: assert_reproducible with this
    session's defaults (ini divergence_*), the traces named after the test and kept if it fails."""
    return _checker(request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("reproducible") is not None:
        run_marker(item, _checker(item))  # fails the test with the report as its whole message
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "teardown":  # the test's divergence-check-* folders: copied to artifacts if asked, then gone
        _remove_scratch()
    if call.excinfo is not None and report.failed and item.config.stash[SETTINGS].artifacts is not None:
        exc = call.excinfo.value
        before = str(exc)
        kept = keep_artifacts(item.config.stash[SETTINGS], item.nodeid, exc)
        if str(exc) != before:  # it now names the kept copies: show that text
            report.longrepr = item.repr_failure(call.excinfo)
        if kept:
            report.sections.append(("divergence artifacts", "\n".join(kept)))
            report.user_properties.append(("divergence_artifacts", " ".join(kept)))
    return report


def _remove_scratch() -> None:
    while SCRATCH:
        shutil.rmtree(SCRATCH.pop(), ignore_errors=True)

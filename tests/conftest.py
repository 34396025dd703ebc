"""Shared fixtures: the embedded fixture models, loaded once per session, and
tiny random-weight models of the other families."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The optimized BLAS (where installed, as .ci/run does) before any test module imports
# mlx at collection: a test file that does would leave the whole session on the
# reference BLAS, and the OpenBLAS-dependent tests would test nothing.
import divergence.engine.kernels.blas  # noqa: F401,E402

pytest_plugins = ["pytester"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Probe results, proofs and vocabularies go to a cache of this test run, never the user's:
# tests swap in stand-in kernels, and what a session measures must not outlive it. Made by
# the first process that loads this file (pytest-xdist's controller, before its workers
# start: they inherit it, so the run shares one cold cache, as on CI), removed at its exit.
if "DIVERGENCE_CACHE_DIR" not in os.environ:
    os.environ["DIVERGENCE_CACHE_DIR"] = tempfile.mkdtemp(prefix="divergence-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DIVERGENCE_CACHE_DIR"], ignore_errors=True)

# This session's own temp dir (children inherit TMPDIR): what the commands under test leave
# there is checked at the end, whatever else runs on the machine.
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="divergence-tests-"))
os.environ["TMPDIR"] = str(_SESSION_TMP)
tempfile.tempdir = None  # (read TMPDIR again)
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)  # pytest's tmp_path trees live in it too


@pytest.fixture(scope="session", autouse=True)
def no_temp_dirs_left():
    """No replay, confirm, check or rank leaves a divergence-* directory behind (issue 28)."""
    yield
    left = sorted(p.name for p in _SESSION_TMP.glob("divergence-*"))
    assert not left, f"temporary directories left behind: {left}"


def pytest_report_header(config):
    """Which kernels this session's fp32 results come from (.ci/blas-cores forces each core)."""
    from divergence.engine.kernels.blas import blas_core, blas_in_use, blas_threads

    core = blas_core()
    return f"divergence BLAS: {blas_in_use()}" + (f", core {core}, {blas_threads()} threads" if core else "")


@pytest.fixture(scope="session")
def target():
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET

    return load_model(TARGET)


@pytest.fixture(scope="session")
def draft():
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import DRAFT

    return load_model(DRAFT)


@pytest.fixture(scope="session")
def target_4bit():
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET_4BIT

    return load_model(TARGET_4BIT)


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    """random_model(model_type, **kw) -> LoadedModel of a tiny random-weight model (cached)."""
    from divergence.engine.model.loading import load_model
    from divergence.testing.models import make_random_model

    made = {}

    def make(model_type="llama", **kw):
        key = (model_type, json.dumps(kw, sort_keys=True))  # (kw may hold dicts: extra_config)
        if key not in made:
            path = tmp_path_factory.mktemp(f"rand-{model_type}")
            made[key] = load_model(make_random_model(path, model_type=model_type, **kw))
        return made[key]

    return make


PROMPTS = [
    "Return the number of",
    "Create a new dictionary with keys from",
    "The socket module provides",
    "Open file and return a stream.",
    "If the object",
    "Decode the object using the codec",
    "This module provides regular expression",
    "Convert a number or string to an integer",
]


@pytest.fixture(scope="session")
def prompts():
    return list(PROMPTS)

"""The plugin's settings (ini keys and options), checked once at configure time.

Deliberately free of MLX and of the engine (policies come from the mlx-free divergence.core.policy): pytest
imports the plugin in every project of an environment where divergence is installed.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.policy import KernelPolicy  # mlx-free, outside the engine package (which loads BLAS)
from ..errors import DivergenceInputError, PolicyError

DEFAULT_POLICY = "native"
DEFAULT_TOP_K = 8
DEFAULT_MAX_TOKENS = 64

POLICY_HELP = "native | batch-invariant | threshold:N"  # the policies a user picks; KernelPolicy takes more


@dataclass(frozen=True)
class Settings:
    """Defaults for the `divergence_check` fixture and the `reproducible` marker."""

    model: Path | None = None  # None: the embedded fixture model
    draft: Path | None = None
    policy: str = DEFAULT_POLICY
    top_k: int = DEFAULT_TOP_K
    max_tokens: int = DEFAULT_MAX_TOKENS
    confirm: bool = True
    artifacts: Path | None = None  # where failing checks keep their traces
    bitwise: bool = False  # equal tokens with other logits fail too


def check_policy(policy) -> str:
    """A policy string, normalised; DivergenceInputError when it cannot be one."""
    try:
        return str(KernelPolicy.parse(policy))
    except PolicyError:
        raise DivergenceInputError(f"unknown kernel policy {policy!r} (expected {POLICY_HELP})") from None


def check_marker_args(kwargs: dict) -> dict:
    """A `reproducible` marker's arguments checked as the ini keys are (the model-dependent ones,
    top_k against the vocabulary, prompts against the context, when the model loads): a bad one
    is one DivergenceInputError line, never a value taken as something else ('maybe' as true)."""
    out = dict(kwargs)
    for name in ("confirm", "bitwise", "stop_at_eos"):
        if out.get(name) is not None:
            out[name] = parse_bool(name, out[name])
    for name in ("top_k", "max_tokens", "token_budget"):
        if out.get(name) is not None:
            out[name] = check_positive_int(name, out[name])
    if out.get("spec_k") is not None:
        out["spec_k"] = check_positive_int("spec_k", out["spec_k"], least=0)
    if out.get("policy") is not None:
        out["policy"] = check_policy(out["policy"])
    return out


def check_positive_int(name: str, value, *, least: int = 1) -> int:
    try:
        n = int(str(value).strip())  # (ini values are text; True, 2.5 and '2.5' are refused)
    except ValueError:
        raise DivergenceInputError(f"{name} must be an integer >= {least}, got {value!r}") from None
    if n < least:
        raise DivergenceInputError(f"{name} must be an integer >= {least}, got {value!r}")
    return n


def check_model_dir(name: str, value, base: Path) -> Path:
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base / path
    if not path.is_dir():
        raise DivergenceInputError(f"{name}: model directory not found: {path}")
    return path


def parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise DivergenceInputError(f"{name} must be true or false, got {value!r}")


def artifact_name(nodeid: str, limit: int = 120) -> str:
    """A test node id as one safe folder name: 'tests/test_a.py::test_x[p-1]' -> 'tests_test_a.py__test_x_p-1'."""
    name = nodeid.replace("::", "__")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "test"
    if len(name) > limit:  # keep it unique when cut
        name = name[:limit - 9] + "-" + hashlib.sha1(nodeid.encode()).hexdigest()[:8]
    return name

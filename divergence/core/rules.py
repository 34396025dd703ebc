"""Input rules every front end applies the same way (the CLI, the pytest plugin, the API,
the engine): each lives here once, and its refusal is one line."""
from __future__ import annotations

from numbers import Integral

from ..errors import PromptError
from .names import SCHEDULES


def at_least_one(name: str, value, error: type[Exception] = PromptError) -> int:
    """An integer >= 1 (numpy's too; not a bool, not a float): int(value), else error('NAME must be ...')."""
    __tracebackhide__ = True  # (a plugin argument's error points at the test's line)
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise error(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def schedules(value, *, to_compare: bool = False) -> tuple[str, ...]:
    """A schedule list ("serial,concurrent" or a sequence): known names, each once, at least
    one (two where they are to be compared)."""
    __tracebackhide__ = True
    names = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else list(value)
    for s in names:
        check_schedule(s)
    if len(set(names)) != len(names) or len(names) < (2 if to_compare else 1):
        what = "two or more distinct schedules to compare" if to_compare else "distinct schedule names"
        raise PromptError(f"schedules: needs {what}, got {names}")
    return tuple(names)


def check_schedule(name) -> str:
    __tracebackhide__ = True
    if name not in SCHEDULES:
        raise PromptError(f"unknown schedule {name!r} (expected {', '.join(SCHEDULES)})")
    return name

"""The HTML page that `report` writes and `bisect --html` writes too: where it may go, and writing it."""
from __future__ import annotations

from pathlib import Path

from ..errors import DivergenceInputError


def check_out(path) -> Path:
    """The page's path, refused before any work when it can't be a file."""
    p = Path(path)
    if p.is_dir():
        raise DivergenceInputError(f"--html {p} is a directory; name the page's file, e.g. {p / 'report.html'}")
    if p.parent.exists() and not p.parent.is_dir():
        raise DivergenceInputError(f"--html {p}: {p.parent} is not a directory")
    return p


def write_page(report, a, b, path) -> str:
    """Write the page; returns the line to tell the user."""
    from ..analysis.html import write_html

    try:
        p = write_html(report, a, b, path)
    except OSError as e:
        raise DivergenceInputError(f"cannot write {path}: {e.strerror or e}") from None
    return f"html report: {p} ({p.stat().st_size / 1024:.0f} KiB)"

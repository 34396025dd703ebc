"""The HTML page that `report` writes and `bisect --html` writes too: where it may go, and writing it."""
from __future__ import annotations

from pathlib import Path

from ..core.atomic import write_atomic
from ..errors import DivergenceInputError
from .paths import HTML, check_output_file


def check_out(path, inputs=()) -> Path:
    """The page's path, refused before any work when it can't be a file, is one of `inputs`
    (the traces: `report A B --html A` would destroy A), or is a file other than an HTML page."""
    return check_output_file(path, flag="--html", inputs=inputs, kind=HTML)


def write_page(report, a, b, path) -> str:
    """Write the page atomically (a failed write keeps an old page); returns the line to tell the user."""
    from ..analysis.html import render_html  # (lazy: loads numpy and h5py; the parser imports every command)

    p = Path(path)
    text = render_html(report, a, b)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(p, text)
    except OSError as e:
        raise DivergenceInputError(f"cannot write {path}: {e.strerror or e}") from None
    return f"html report: {p} ({p.stat().st_size / 1024:.0f} KiB)"

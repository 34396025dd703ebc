"""The HTML report: one self-contained page of a diverged pair (see page.py).

    from divergence.analysis.html import write_html
    write_html(bisect_report, trace_a, trace_b, "report.html")
"""
from __future__ import annotations

from .page import render as render_html
from .page import write as write_html

__all__ = ["render_html", "write_html"]

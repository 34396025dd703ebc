"""Pieces shared by subcommands: model options, JSON output, opening traces."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def emit_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=_default)
    sys.stdout.write("\n")


def _default(o):
    import numpy as np  # (lazy: loads numpy; the parser imports every command)

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def open_pair(path_a, path_b):
    from ..trace.reader import Trace  # (lazy: loads h5py)

    a = Trace.open(path_a)
    try:
        b = Trace.open(path_b)
    except Exception:
        a.close()
        raise
    return a, b


def add_model_args(p, *, draft: bool = True) -> None:
    p.add_argument("--model", metavar="DIR", help="mlx-lm model directory (default: the embedded fixture model)")
    if draft:
        p.add_argument("--draft", metavar="DIR", help="draft model directory for speculative decoding "
                       "(default with --spec-k: the embedded fixture draft)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="run the model in this dtype (default: the model's own)")


def default_model_dirs():
    """The embedded fixture models: the installed package, or the repo's fixtures/
    folder when running from a source tree on PYTHONPATH (no install)."""
    from ..testing.models import fixture_dirs  # (lazy: the parser imports every command)

    return fixture_dirs()

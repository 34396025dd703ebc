"""Reading schema-1 files: each table a group of equal-length 1-D datasets (plus
/tokens/topk_ids and /tokens/topk_logits, [n, top_k]); a killed writer may leave
the columns of a table at different lengths, cut here to the shortest."""
from __future__ import annotations

import h5py
import numpy as np

from . import schema as S


def read_v1_table(f: h5py.File, t: S.Table, *, refresh: bool) -> dict[str, np.ndarray]:
    """Columns of table `t` that the file holds, schema-2 names, equal length."""
    if t.v1 is None or t.v1 not in f:
        return {}
    g = f[t.v1]
    names = [c for c in (*t.columns, *t.derived) if c in g and isinstance(g[c], h5py.Dataset)]
    ds = {c: g[c] for c in names}
    if refresh:
        for d in ds.values():
            d.refresh()  # a live (or killed) SWMR writer may have appended
    if not ds:
        return {}
    n = min(d.shape[0] for d in ds.values())
    return {c: d[:n] for c, d in ds.items()}

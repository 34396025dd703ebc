"""The table section of docs/trace-format.md, from schema.TABLES.

    python tests/trace/docs_tables.py      # rewrite that section in place
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

DOC = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"
START, END = "### `/steps`", "`tokens.topk_ids` / `tokens.topk_logits`"


def tables_markdown() -> str:
    from divergence.trace import schema as S

    out = []
    for name, t in S.TABLES.items():
        where = f" (schema 1: group `/{t.v1}`)" if t.v1 else " (new in schema 2)"
        out.append(f"### `/{name}`{where}\n\n{t.description[0].upper() + t.description[1:]}.\n")
        out.append("| column | dtype | default | meaning |\n|---|---|---|---|")
        for c, col in t.columns.items():
            dt = np.dtype(col.dtype).name + (f" [{col.width}]" if col.width is not None else "")
            d = "NaN" if isinstance(col.default, float) and col.default != col.default else str(col.default)
            out.append(f"| `{c}` | {dt} | {d} | {col.description} |")
        for c, src in t.derived.items():
            out.append(f"| `{c}` | (derived) | = `{src}` | not stored in schema 2; readers give `{src}` "
                       f"(schema 1 stored it) |")
        out.append("")
    return "\n".join(out) + "\n"


def section(text: str) -> str:
    return text[text.index(START): text.index(END)]


if __name__ == "__main__":
    sys.path.insert(0, str(DOC.parents[1]))
    text = DOC.read_text()
    DOC.write_text(text.replace(section(text), tables_markdown()))

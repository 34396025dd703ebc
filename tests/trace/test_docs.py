"""docs/trace-format.md lists every table and column of schema.TABLES, as declared."""
from __future__ import annotations

from divergence.trace import schema as S

from .docs_tables import DOC, section, tables_markdown


def test_the_docs_tables_are_the_schemas():
    text = DOC.read_text()
    assert section(text) == tables_markdown(), "regenerate: python tests/trace/docs_tables.py"
    assert f"schema version {S.SCHEMA_VERSION}" in text

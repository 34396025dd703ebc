"""mkdocs hooks: pages that other work adds appear once their files exist.

- `docs/privacy.md` joins the nav after "Serve, rerun and explain" when it exists.
- A line `<!-- optional-output: NAME.txt | SENTENCE -->` in a page becomes a code block of
  `docs/generated/NAME.txt` when that file exists, and SENTENCE otherwise.
- `<!-- package-tree -->` becomes divergence/'s packages and modules as they are, each with
  its docstring's first sentence, and `<!-- rooms -->` the import rule of
  tests/core/test_layers.py: the architecture page draws the code as it is at build time.
"""
from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent
_OPTIONAL = re.compile(r"^<!-- optional-output: (\S+) \| (.*?) -->$", re.M)


def on_config(config):
    if (DOCS / "privacy.md").exists() and not any("privacy.md" in str(item) for item in config.nav):
        at = next((i + 1 for i, item in enumerate(config.nav) if "serve.md" in str(item)), len(config.nav))
        config.nav.insert(at, {"Privacy": "privacy.md"})
    return config


def on_page_markdown(markdown, page, config, files):
    def fill(m):
        path = DOCS / "generated" / m.group(1)
        if path.exists():
            return "```\n" + path.read_text().rstrip("\n") + "\n```"
        return m.group(2)

    return _fill_layout(_OPTIONAL.sub(fill, markdown))


def _first_line(path: Path) -> str:
    """A module's docstring's first sentence (read with ast: nothing is imported)."""
    import ast

    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except SyntaxError:
        return ""
    line = " ".join(doc.split("\n\n")[0].split())
    line = line.split(". ")[0].rstrip(".")
    return line if len(line) <= 90 else line[:87].rsplit(" ", 1)[0] + " ..."


def package_tree(root: Path) -> str:
    """divergence/ as it is: every package and module with its docstring's first sentence."""
    lines = []
    for d in sorted(p for p in [root, *root.rglob("*")] if p.is_dir() and (p / "__init__.py").exists()):
        rel = d.relative_to(root.parent).as_posix() + "/"
        lines.append(f"{rel:34} {_first_line(d / '__init__.py')}".rstrip())
        for f in sorted(d.glob("*.py")):
            if f.name != "__init__.py":
                lines.append(f"    {f.name:30} {_first_line(f)}".rstrip())
    return "\n".join(lines)


def rooms_table(test_file: Path) -> str:
    """The ROOMS of tests/core/test_layers.py as a table: room -> the rooms it may import."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_layers_rule", test_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = ["| room | may import |", "|---|---|"]
    for room, allowed in mod.ROOMS.items():
        may = "anything" if allowed is None else ", ".join(f"`{r}`" for r in sorted(allowed)) or "nothing"
        rows.append(f"| `{room}` | {may} |")
    return "\n".join(rows)


_ROOT = DOCS.parent


def _fill_layout(markdown: str) -> str:
    if "<!-- package-tree -->" in markdown:
        markdown = markdown.replace("<!-- package-tree -->",
                                    "```\n" + package_tree(_ROOT / "divergence") + "\n```")
    if "<!-- rooms -->" in markdown:
        markdown = markdown.replace("<!-- rooms -->", rooms_table(_ROOT / "tests" / "core" / "test_layers.py"))
    return markdown

"""What the README and the docs show is what the commands print.

Every shown output is made by docs/gen_outputs.py (into docs/generated/, and the README's demo
block from it). Here the cheap shows run again and must match the committed files after
normalize() (timings, the BLAS line and temporary paths masked); the README's block must be
the generated file; the performance page must be what bench/results/ gives; and the README's
table must name every command. When a command's output changes on purpose, run
`python docs/gen_outputs.py NAME` (or `docs/gen_performance.py`) and commit the result.
"""
from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


gen = _load("gen_outputs")
CHECKED = [name for name, show in gen.SHOWS.items() if show.checked]


def _diff(want: str, got: str) -> str:
    return "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(), "committed", "now", lineterm="", n=2))


@pytest.mark.parametrize("name", CHECKED)
def test_a_shown_output_is_what_the_commands_print_now(name, tmp_path):
    committed = (DOCS / "generated" / f"{name}.txt").read_text()
    fresh = gen.run_show(name, workdir=tmp_path)
    want, got = gen.normalize(committed), gen.normalize(fresh)
    assert got == want, (f"docs/generated/{name}.txt no longer matches what its commands print "
                         f"(run: python docs/gen_outputs.py {name}):\n{_diff(want, got)}")


def test_every_show_has_its_generated_file_and_every_page_include_exists():
    for name in gen.SHOWS:
        text = (DOCS / "generated" / f"{name}.txt").read_text()
        assert text.startswith(f"$ {gen.SHOWS[name].commands[0]}\n"), name
    for page in DOCS.glob("*.md"):
        for inc in re.findall(r'--8<-- "([^"]+)"', page.read_text()):
            assert (DOCS / inc).exists(), f"{page.name} includes {inc}, which does not exist"


def test_the_readme_shows_the_generated_demo_exactly():
    readme = (ROOT / "README.md").read_text()
    demo = (DOCS / "generated" / "demo.txt").read_text()
    assert gen.readme_with(demo, readme) == readme, "README's demo block differs: run python docs/gen_outputs.py demo"


def test_normalize_masks_timings_and_machines_but_not_results():
    a = "serial      4 requests, 257 tokens, 433 steps (112 target), 4.0 s -> traces/serial.h5\nBLAS: x\n"
    b = "serial      4 requests, 257 tokens, 433 steps (112 target), 12.5 s -> traces/serial.h5\nBLAS: y\n"
    assert gen.normalize(a) == gen.normalize(b)
    assert gen.normalize(a) != gen.normalize(a.replace("433 steps", "434 steps"))
    assert gen.normalize("logit 6.125000") != gen.normalize("logit 6.093750")


def test_the_performance_page_is_what_the_bench_results_give():
    perf = _load("gen_performance")
    assert (DOCS / "performance.md").read_text() == perf.render(), \
        "docs/performance.md is out of date: run python docs/gen_performance.py"


def test_the_readme_table_names_every_command():
    from divergence.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    table = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `divergence ")]
    named = {re.match(r"\| `divergence (\w+)", line).group(1) for line in table}
    missing = sorted(set(sub.choices) - named)
    assert not missing, f"commands missing from the README's table: {missing}"

#!/usr/bin/env python3
"""Every command output that the README and the documentation show, made by running the commands.

    python docs/gen_outputs.py              # all of them (a few minutes on 2 cores)
    python docs/gen_outputs.py demo tp      # some
    python docs/gen_outputs.py --list       # their names, and which tests/docs re-runs

Each show runs its commands in a fresh temporary directory, as a user would type them there,
and writes `docs/generated/NAME.txt`: each command after `$ `, then what it printed (stdout
and stderr as a terminal interleaves them). The repository's own path is written as the
path relative to it, the temporary directory's as nothing. The README's demo block is
rewritten from `demo.txt` (between its `generated:` markers), so the README shows exactly
what the docs show. The pages include the files; nothing is pasted.

tests/docs/test_shown_output.py runs the shows marked `checked` again and compares them with
the committed files after `normalize` (timings, the BLAS line and temporary paths masked):
a command whose output changed fails CI until this script is run again.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "docs" / "generated"
README = ROOT / "README.md"

PROMPTS_STEP = "\n".join(
    '{"id": "p%d", "prompt": "%s", "max_tokens": 12}' % (i, t) for i, t in enumerate([
        "The socket module provides", "Return the number of", "This function is deprecated since",
        "Create a new thread", "Raise an exception if the", "The default encoding is", "Open the file and",
        "If the argument is omitted"])) + "\n"

PROMPTS_MOE = "\n".join('{"id": "r%d", "prompt": "%s", "max_tokens": 24, "arrival": %d}' % (i, t, a) for i, (t, a) in
                        enumerate([("Return the number of", 0), ("The socket module provides", 2),
                                   ("If the object", 0), ("Convert a number or string to an integer", 5)])) + "\n"

PROMPTS_SAMPLED = "\n".join(
    '{"id": "r%d", "prompt": "%s", "arrival": %d, "max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": %d}'
    % (i + 1, t, 2 * i, 7 + i) for i, t in enumerate([
        "The socket module provides", "Return the number of", "If the object", "Open file and return a stream."])) + "\n"

MAKE_MOE = ("from divergence.testing.models import make_random_model; "
            "make_random_model('moe', model_type='qwen3_moe', hidden_size=64, num_layers=2, num_experts=8, "
            "experts_per_token=2, dtype='bfloat16', planted_tie=(1, 1e-3))")


@dataclass
class Show:
    """Commands whose output a page shows. `files` are written into the working directory
    first (shown on the page as they are); `checked`: tests/docs re-runs it and compares."""
    commands: list[str]
    about: str
    checked: bool = True
    files: dict[str, str] = field(default_factory=dict)
    copy: tuple[str, ...] = ()  # repository files the commands use, copied to the same relative path


SHOWS: dict[str, Show] = {
    "demo": Show(
        ["divergence run", "divergence bisect traces/serial.h5 traces/concurrent.h5 --confirm"],
        "the embedded demo: a cache contamination, confirmed by replay"),
    "step_compute": Show(
        ["cat prompts.jsonl",
         "divergence run --policy threshold:4 --spec-k 0 --prompts prompts.jsonl --ignore-eos --out traces",
         "divergence bisect traces/serial.h5 traces/concurrent.h5 --bitwise --confirm"],
        "eight prompts prefilled in one step: step compute (and one cache contamination)",
        files={"prompts.jsonl": PROMPTS_STEP}),
    "sampled": Show(
        ["cat sampled.jsonl",
         "divergence run --prompts sampled.jsonl --spec-k 3 --policy threshold:4 --ignore-eos --out traces",
         "divergence bisect traces/serial.h5 traces/concurrent.h5 --confirm"],
        "sampled requests with speculative decoding: where each flip's uniform draw fell",
        checked=False, files={"sampled.jsonl": PROMPTS_SAMPLED}),
    "routing": Show(
        ["cat moe.jsonl", f'python -c "{MAKE_MOE}"',
         "divergence run --model moe --policy threshold:1 --prompts moe.jsonl --ignore-eos --out traces",
         "divergence bisect traces/serial.h5 traces/concurrent.h5 --bitwise --confirm"],
        "a random qwen3_moe with a near-tied router: routing flips",
        files={"moe.jsonl": PROMPTS_MOE}),
    "tp": Show(
        ["divergence run --model fixtures/target --schedules serial --max-tokens 16 --ignore-eos --out tp1",
         "divergence run --model fixtures/target --schedules serial --max-tokens 16 --ignore-eos --tp 2 --out tp2",
         "divergence bisect tp1/serial.h5 tp2/serial.h5 --bitwise --confirm"],
        "TP=1 against TP=2 on two local ranks: tensor parallel", checked=False, copy=("fixtures/target",)),
    "environment": Show(
        ["divergence run --dtype float32 --policy native --spec-k 0 --schedules serial --max-tokens 16 "
         "--ignore-eos --out optimized",
         "divergence run --reference-blas --dtype float32 --policy native --spec-k 0 --schedules serial "
         "--max-tokens 16 --ignore-eos --out reference",
         "divergence bisect optimized/serial.h5 reference/serial.h5 --bitwise --confirm"],
        "one schedule under OpenBLAS and under the reference BLAS: environment (its numbers depend on the "
        "CPU's OpenBLAS core, so the tests do not compare it)", checked=False),
    "own_engine": Show(
        ["python examples/toy_engine.py --schedule serial --out runs/serial",
         "python examples/toy_engine.py --schedule concurrent --out runs/concurrent",
         "divergence import runs/serial --out serial.h5",
         "divergence import runs/concurrent --out concurrent.h5",
         "divergence bisect serial.h5 concurrent.h5",
         "divergence bisect serial.h5 concurrent.h5 --confirm-cmd "
         "'python examples/toy_engine.py --schedule concurrent --split-step {step} --out {out}'"],
        "another engine's traces: a lead only, then confirmed by that engine's own re-run",
        copy=("examples/toy_engine.py",)),
}


def _argv(command: str) -> list[str]:
    """The command as this interpreter runs it: `divergence` is this checkout's package."""
    words = shlex.split(command)
    if words[0] == "divergence":
        return [sys.executable, "-m", "divergence", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return words


def environment() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("DIVERGENCE_BLAS", None)
    return env


def run_show(name: str, workdir: Path | None = None) -> str:
    """The text of one show: every command after `$ ` and its output, paths made relative."""
    show = SHOWS[name]
    with tempfile.TemporaryDirectory(prefix=f"divergence-docs-{name}-") as tmp:
        work = Path(workdir or tmp).resolve()
        for rel, text in show.files.items():
            (work / rel).write_text(text)
        for rel in show.copy:
            src, dst = ROOT / rel, work / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
        out = []
        for command in show.commands:
            proc = subprocess.run(_argv(command), cwd=work, env=environment(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=600)
            out.append(f"$ {command}\n{proc.stdout}")
        text = "".join(out)
        for path in (str(work) + "/", str(work), str(ROOT) + "/", str(ROOT)):
            text = text.replace(path, "")
        return _FIXTURES.sub(r"fixtures/\2", text)


# the fixture models, wherever the installed package keeps them
_FIXTURES = re.compile(r"(?<![\w/])/\S*?/(divergence/)?fixtures/(target|draft)")
_TIMING = re.compile(r"\b\d+(?:\.\d+)? s\b")
_TMP = re.compile(r"(?:/tmp|/var/folders)/\S*?(?=[/\s)])")


def normalize(text: str) -> str:
    """What must stay equal between a committed show and a fresh run of it: timings, the line
    naming the BLAS in use and temporary directories are masked (they vary by machine and run)."""
    text = _TIMING.sub("<t> s", text)
    text = re.sub(r"(?m)^BLAS: .*$", "BLAS: <blas>", text)
    text = _TMP.sub("<tmp>", text)
    text = _FIXTURES.sub(r"fixtures/\2", text)
    return text


def readme_with(demo: str, readme: str) -> str:
    """The README with its demo block replaced by `demo`."""
    start, end = "<!-- generated: docs/generated/demo.txt -->\n```\n", "```\n<!-- end generated -->"
    i, j = readme.index(start) + len(start), readme.index(end)
    return readme[:i] + demo + readme[j:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"shows to make (default all: {', '.join(SHOWS)})")
    ap.add_argument("--list", action="store_true", help="list the shows and exit")
    args = ap.parse_args()
    if args.list:
        for name, show in SHOWS.items():
            print(f"{name:13} {'checked' if show.checked else 'shown  '}  {show.about}")
        return 0
    unknown = [n for n in args.names if n not in SHOWS]
    if unknown:
        print(f"gen_outputs: unknown show {', '.join(unknown)} (known: {', '.join(SHOWS)})", file=sys.stderr)
        return 2
    GENERATED.mkdir(parents=True, exist_ok=True)
    for name in args.names or SHOWS:
        text = run_show(name)
        tmp = GENERATED / f".{name}.txt.tmp"
        tmp.write_text(text)
        tmp.replace(GENERATED / f"{name}.txt")
        print(f"wrote docs/generated/{name}.txt ({len(text.splitlines())} lines)")
        if name == "demo":
            README.write_text(readme_with(text, README.read_text()))
            print("rewrote the README's demo block")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bad input (issue 30): one line on stderr, exit 2, no traceback, nothing changed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from divergence.cli.main import main

TRACES = Path(__file__).parents[2] / "traces" / "v1"


def run(args, capsys):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err.strip().splitlines()


def one_line(rc, err, *needles):
    assert rc == 2, (rc, err)
    assert len(err) == 1, err
    for n in needles:
        assert n in err[0], err


@pytest.fixture
def pair(tmp_path):
    a, b = tmp_path / "serial.h5", tmp_path / "concurrent.h5"
    shutil.copy(TRACES / "serial.h5", a)
    shutil.copy(TRACES / "concurrent.h5", b)
    return a, b


def _snapshot(d: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


# -- 2. output paths, checked before any work --------------------------------------------------

def test_replay_out_is_not_its_input(pair, capsys):
    a, _ = pair
    before = _snapshot(a.parent)
    rc, _, err = run(["replay", a, "--out", a], capsys)
    one_line(rc, err, "inputs")
    assert _snapshot(a.parent) == before


def test_replay_out_through_a_hard_link_is_its_input(pair, capsys):
    a, _ = pair
    link = a.parent / "link.h5"
    os.link(a, link)
    rc, _, err = run(["replay", a, "--out", link], capsys)
    one_line(rc, err, "inputs")


@pytest.mark.parametrize("which", [0, 1])
def test_report_html_is_not_a_trace(pair, capsys, which):
    before = _snapshot(pair[0].parent)
    rc, _, err = run(["report", *pair, "--html", pair[which]], capsys)
    one_line(rc, err, "--html", "inputs")
    assert _snapshot(pair[0].parent) == before


def test_bisect_html_is_not_a_trace_nor_a_directory(pair, capsys, tmp_path):
    rc, _, err = run(["bisect", *pair, "--html", pair[1]], capsys)
    one_line(rc, err, "--html", "inputs")
    rc, _, err = run(["bisect", *pair, "--html", tmp_path], capsys)
    one_line(rc, err, "is a directory")
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = run(["bisect", *pair, "--html", f / "r.html"], capsys)
    one_line(rc, err, "regular file")


def test_import_out_is_not_one_of_its_records(tmp_path, capsys):
    src = tmp_path / "rec"
    src.mkdir()
    (src / "requests.jsonl").write_text('{"id": "r1", "prompt_tokens": [1, 2]}\n')
    rc, _, err = run(["import", src, "--out", src / "requests.jsonl"], capsys)
    one_line(rc, err, "inputs")
    assert (src / "requests.jsonl").read_text() == '{"id": "r1", "prompt_tokens": [1, 2]}\n'


def test_run_out_under_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = run(["run", "--out", f / "traces", "--max-tokens", "2"], capsys)
    one_line(rc, err, "regular file")
    assert f.read_text() == "x"


def test_run_out_whose_trace_is_a_directory(tmp_path, capsys):
    (tmp_path / "serial.h5").mkdir()
    rc, _, err = run(["run", "--out", tmp_path, "--max-tokens", "2"], capsys)
    one_line(rc, err, "serial.h5 is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serial.h5"]


def _read_only_dir(tmp_path) -> Path:
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        return d
    # root ignores permission bits: a read-only mount refuses root too
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("root, and no read-only mount here")
    return d


@pytest.fixture
def ro_dir(tmp_path):
    d = _read_only_dir(tmp_path)
    yield d
    if os.geteuid() == 0:
        subprocess.run(["umount", str(d)], capture_output=True)
    else:
        d.chmod(0o755)


def test_run_out_in_a_read_only_dir(ro_dir, capsys):
    rc, _, err = run(["run", "--out", ro_dir / "traces", "--max-tokens", "2"], capsys)
    one_line(rc, err, "--out")
    rc, _, err = run(["run", "--out", ro_dir, "--max-tokens", "2"], capsys)
    one_line(rc, err, "--out")


def test_report_html_in_a_read_only_dir(pair, ro_dir, capsys):
    rc, _, err = run(["report", *pair, "--html", ro_dir / "r.html"], capsys)
    one_line(rc, err, "--html")

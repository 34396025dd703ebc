"""Files other than traces are written atomically: a unique temporary in the target's
directory, fsynced, renamed; a failed write (a full disk) keeps the old file and leaves
no temporary behind."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from divergence.cli.main import main
from divergence.core.atomic import temp_name, write_atomic

TRACES = Path(__file__).parents[2] / "traces" / "v1"


def run(args, capsys):
    capsys.readouterr()
    rc = main(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err.strip().splitlines()


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_write_atomic_replaces_whole(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("old")
    os.chmod(p, 0o640)
    write_atomic(p, "new text")
    assert p.read_text() == "new text" and (p.stat().st_mode & 0o777) == 0o640
    assert sorted(tmp_path.iterdir()) == [p]


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_a_full_disk_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch, where):
    p = tmp_path / "probe.json"
    p.write_text("previous")
    monkeypatch.setattr(os, where, _enospc)
    with pytest.raises(OSError) as e:
        write_atomic(p, "x" * 100_000)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert p.read_text() == "previous" and sorted(tmp_path.iterdir()) == [p]


def test_temp_names_are_unique(tmp_path):
    p = tmp_path / "serial.h5"
    names = {temp_name(p, "partial") for _ in range(100)}
    assert len(names) == 100 and all(n.parent == tmp_path and str(os.getpid()) in n.name for n in names)


def test_a_failed_html_write_keeps_the_old_page(tmp_path, capsys, monkeypatch):
    page = tmp_path / "report.html"
    page.write_text("<!DOCTYPE html><p>the old page")
    monkeypatch.setattr(os, "fsync", _enospc)
    rc, _, err = run(["report", str(TRACES / "serial.h5"), str(TRACES / "concurrent.h5"), "--html", str(page)],
                     capsys)
    assert rc == 2 and len(err) == 1 and "No space left" in err[0], err
    assert page.read_text() == "<!DOCTYPE html><p>the old page" and sorted(tmp_path.iterdir()) == [page]


def test_the_html_page_is_written_whole(tmp_path, capsys):
    page = tmp_path / "report.html"
    page.write_text("<!DOCTYPE html><p>the old page")
    rc, _, err = run(["report", str(TRACES / "serial.h5"), str(TRACES / "concurrent.h5"), "--html", str(page)],
                     capsys)
    assert rc in (0, 1), err
    assert page.read_text().startswith("<!DOCTYPE html>") and sorted(tmp_path.iterdir()) == [page]


def test_a_full_disk_keeps_the_probe_cache(tmp_path, capsys, monkeypatch):
    """probe's cache (probe.json) is written atomically: a failed write keeps the old file whole."""
    import divergence.core.atomic as atomic

    monkeypatch.setenv("DIVERGENCE_CACHE_DIR", str(tmp_path))
    cache = tmp_path / "probe.json"
    cache.write_text("{}")
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(cache)):
            _enospc()
        return real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    rc, _, err = run(["probe", "--rows", "1,2", "--kv-lens", "64", "--json"], capsys)
    assert rc == 0, err  # the cache is a cache: the probe still reports
    assert cache.read_text() == "{}" and not list(tmp_path.glob("probe.json.*"))

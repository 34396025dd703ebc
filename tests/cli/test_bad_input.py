"""Bad input (issue 30): one line on stderr, exit 2, no traceback, nothing changed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from divergence.cli.main import main
from divergence.cli.paths import remember_outputs

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


# -- 3. one --out, one run at a time; unique partial names ------------------------------------

def test_a_second_run_on_one_out_is_refused(tmp_path, capsys):
    from divergence.workloads.runner import _lock, _unlock

    (tmp_path / "serial.h5").write_bytes(b"previous")
    remember_outputs([tmp_path / "serial.h5"], command="run")  # an earlier run's (else refused as another's file)
    held = _lock(tmp_path)  # as another `divergence run` holds it (flock: per open file)
    try:
        rc, _, err = run(["run", "--out", tmp_path, "--max-tokens", "2", "--json"], capsys)
    finally:
        _unlock(held)
    one_line(rc, err, "in use", str(os.getpid()))
    assert (tmp_path / "serial.h5").read_bytes() == b"previous"
    assert not list(tmp_path.glob("*.partial"))


def test_partial_names_are_unique_per_process(tmp_path):
    from divergence.workloads.runner import partial_name

    a, b = partial_name(tmp_path / "serial.h5"), partial_name(tmp_path / "serial.h5")
    assert a != b and a.name != "serial.h5.partial" and str(os.getpid()) in a.name
    assert a.name.startswith("serial.") and a.name.endswith(".h5.partial")  # tp_cli's *.h5.partial


def test_the_lock_is_released_and_removed(tmp_path, capsys):
    rc, out, err = run(["run", "--out", tmp_path, "--max-tokens", "2", "--json", "--schedules", "serial"], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serial.h5"]


# -- 8. a full disk: one line, exit 2, no partial file, old traces kept -------------------------

def test_a_failed_flush_is_one_line_and_no_partial(tmp_path, capsys, monkeypatch):
    import errno

    import h5py

    for name in ("serial.h5", "concurrent.h5"):
        (tmp_path / name).write_bytes(b"previous " + name.encode())
    remember_outputs([tmp_path / "serial.h5", tmp_path / "concurrent.h5"], command="run")  # an earlier run's
    real, calls = h5py.File.flush, []

    def flush(self):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self)

    monkeypatch.setattr(h5py.File, "flush", flush)
    # a write (and its flush) at every hand-off, not every 0.5 s: else a fast machine finishes
    # the serial run within 3 flushes and renames it over the old serial.h5, as a run should
    monkeypatch.setattr("divergence.trace.writer.FLUSH_SECONDS", 0.0)
    rc, _, err = run(["run", "--out", tmp_path, "--max-tokens", "6", "--json"], capsys)
    monkeypatch.undo()
    one_line(rc, err, "No space left on device")
    assert "Traceback" not in "\n".join(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["concurrent.h5", "serial.h5"]
    for name in ("serial.h5", "concurrent.h5"):
        assert (tmp_path / name).read_bytes() == b"previous " + name.encode()


@pytest.mark.parametrize("size", ["160k", "240k", "250k", "300k", "360k"])
def test_a_full_tmpfs_is_one_line_not_a_segfault(tmp_path, size):
    """A real full disk (a small tmpfs, filling at file creation or at a flush, by its size):
    HDF5 crashed (at close or at GC) when it could not write what it held; the writer's
    reserve (trace/reserve.py) gives it room to close."""
    import sys

    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (d / "concurrent.h5").write_bytes(b"previous")
        remember_outputs([d / "concurrent.h5"], command="run")  # an earlier run's (the child shares the cache dir)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
        p = subprocess.run([sys.executable, "-m", "divergence", "run", "--out", str(d), "--json"], env=env,
                           capture_output=True, text=True, timeout=300)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        assert len(lines) == 1 and "No space left on device" in lines[0], lines
        assert not list(d.glob("*.partial*")) and (d / "concurrent.h5").read_bytes() == b"previous"
        assert not list(d.glob(".*.reserve")), "the reserve is given back"
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


# -- 4. prompt files: strict JSON, strict types, regular files only ------------------------------

NESTED = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize("line, field", [
    ('{"id": "r1", "prompt": "x", "temperature": NaN}', "NaN"),
    ('{"id": "r1", "prompt": "x", "temperature": Infinity}', "Infinity"),
    ('{"id": "r1", "prompt": "x", "temperature": -Infinity}', "Infinity"),
    ('{"id": "r1", "prompt": "x", "temperature": 1e999}', "temperature"),
    ('{"id": "r1", "prompt": "x", "top_p": NaN}', "NaN"),
    ('{"id": "r1", "prompt": "x", "max_tokens": "3"}', "max_tokens"),
    ('{"id": "r1", "prompt": "x", "max_tokens": 2.7}', "max_tokens"),
    ('{"id": "r1", "prompt": "x", "max_tokens": true}', "max_tokens"),
    ('{"id": "r1", "prompt": "x", "arrival": 1.5}', "arrival"),
    ('{"id": "r1", "tokens": [true, false]}', "tokens"),
    ('{"id": "r1", "tokens": [1, -2]}', "tokens"),
    ('{"id": "r1", "prompt": "x", "seed": 1.9}', "seed"),
    ('{"id": null, "prompt": "x"}', "'id'"),
    ('{"id": {"a": 1}, "prompt": "x"}', "'id'"),
    ('{"id": true, "prompt": "x"}', "'id'"),
    ('{"id": "r\\u0000x", "prompt": "x"}', "NUL"),
    ('{"id": "r1", "prompt": "x\\ud800"}', "surrogate"),
    ('{"id": "r1", "id": "r2", "prompt": "x"}', "twice"),
    ('{"id": "r1", "prompt": "x", "seed": ' + "9" * 5000 + '}', "not valid JSON"),
    (NESTED, "nested too deeply"),
])
def test_bad_prompt_lines(tmp_path, capsys, line, field):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "ok", "prompt": "fine"}\n' + line + "\n", encoding="utf-8", errors="surrogatepass")
    out = tmp_path / "out"
    rc, _, err = run(["run", "--prompts", f, "--out", out, "--max-tokens", "2", "--json"], capsys)
    one_line(rc, err, f"{f}:2", field)
    assert not out.exists()


def _encode(text):
    return [ord(c) % 200 + 1 for c in text]


def test_a_bom_is_accepted(tmp_path):
    from divergence.workloads.prompts import load_prompts

    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b'{"id": "r1", "prompt": "hi"}\r\n{"id": "r2", "tokens": [5, 6]}\n')
    reqs = load_prompts(f, _encode)
    assert [r.id for r in reqs] == ["r1", "r2"] and reqs[1].prompt_tokens == (5, 6)


def test_a_line_separator_inside_a_string_is_not_a_new_line(tmp_path):
    from divergence.workloads.prompts import load_prompts

    f = tmp_path / "ls.jsonl"
    f.write_text('{"id": "r1", "prompt": "a\u2028b"}\n', encoding="utf-8")
    assert load_prompts(f, _encode)[0].prompt_text == "a\u2028b"


def test_prompts_from_a_fifo_or_a_device_are_refused(tmp_path, capsys):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for src in (fifo, "/dev/zero"):
        rc, _, err = run(["run", "--prompts", src, "--out", tmp_path / "o", "--json"], capsys)
        one_line(rc, err, "not a regular file", str(src))


def test_a_huge_prompt_file_is_refused(tmp_path, capsys, monkeypatch):
    import divergence.workloads.prompts as prompts

    f = tmp_path / "big.jsonl"
    f.write_text('{"id": "r1", "prompt": "' + "x" * 5000 + '"}\n')
    monkeypatch.setattr(prompts, "MAX_PROMPT_FILE_BYTES", 4096)
    rc, _, err = run(["run", "--prompts", f, "--out", tmp_path / "o", "--json"], capsys)
    one_line(rc, err, "at most 4096 bytes")


def test_the_api_raises_prompt_error(tmp_path):
    from divergence.errors import PromptError
    from divergence.workloads.prompts import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "r1", "prompt": "x", "seed": 1.9}\n')
    with pytest.raises(PromptError, match="p.jsonl:1: 'seed' must be an integer"):
        load_prompts(f, _encode)


# -- 5. a model config.json that is not an object ---------------------------------------------

@pytest.mark.parametrize("text, needle", [("[1, 2]", "JSON list"), ('"llama"', "JSON str"),
                                          ("[" * 100_000, "cannot read"), (b"\xff\xfe{}", "cannot read")])
def test_a_config_that_is_not_an_object(tmp_path, capsys, text, needle):
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    rc, _, err = run(["run", "--model", m, "--out", tmp_path / "o", "--json"], capsys)
    one_line(rc, err, "config.json", needle)


# -- 6. sweep and probe -------------------------------------------------------------------------

def test_sweep_with_few_tokens_runs(capsys):
    rc, out, err = run(["sweep", "-n", "1", "--max-tokens", "2", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["runs"] == 1


@pytest.mark.parametrize("args, needle", [(["--max-batch", "100000"], "1..1024"), (["--max-batch", "0"], "1..1024"),
                                          (["--max-tokens", "0"], "--max-tokens")])
def test_sweep_bounds(capsys, args, needle):
    rc, _, err = run(["sweep", "-n", "1", *args], capsys)
    one_line(rc, err, needle)


def test_sweep_api_bounds():
    from divergence.errors import PromptError
    from divergence.workloads.sweep import sweep

    with pytest.raises(PromptError, match="max-batch"):
        sweep(None, "x", runs=1, max_batch=100_000)


@pytest.mark.parametrize("rows", ["1,,2", "1,2,", ",4"])
def test_probe_rows_with_an_empty_item(capsys, rows):
    rc, _, err = run(["probe", "--rows", rows], capsys)
    one_line(rc, err, "--rows", "empty item")
    rc, _, err = run(["probe", "--kv-lens", rows], capsys)
    one_line(rc, err, "--kv-lens", "empty item")


# -- 7. --top-k beyond the vocabulary; a step forced twice ------------------------------------

def test_top_k_beyond_the_vocabulary(tmp_path, capsys):
    rc, _, err = run(["run", "--top-k", "5000", "--max-tokens", "2", "--out", tmp_path / "o", "--json"], capsys)
    one_line(rc, err, "--top-k 5000", "1024")
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


@pytest.mark.parametrize("forces", [["8:gemv", "8:gemm"], ["8:gemv", "8:gemv"], ["8:q_proj=gemv", "8:gemm"],
                                    ["8:q_proj=gemv", "8:q_proj=gemm"], ["8:solo", "8:q_proj=gemv"]])
def test_a_step_forced_twice(capsys, forces):
    args = ["replay", str(TRACES / "concurrent.h5")]
    for f in forces:
        args += ["--force", f]
    rc, _, err = run(args, capsys)
    one_line(rc, err, "--force", "already forced")


def test_distinct_forcings_still_parse():
    from divergence.analysis.replayer import parse_force

    got = parse_force(["8:q_proj=gemv", "8:k_proj=gemm", "9:gemv"])
    assert set(got) == {8, 9} and set(got[8]) == {"q_proj", "k_proj"}

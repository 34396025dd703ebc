"""Bad input: one clear line on stderr, exit 2, no traceback, nothing lost."""
from __future__ import annotations

import json

import pytest

from divergence.cli.main import main
from divergence.cli.paths import remember_outputs


def run(args, capsys):
    capsys.readouterr()
    rc = main(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err.strip().splitlines()


@pytest.mark.parametrize("make, needle", [
    (lambda d: ["--model", str(d / "missing")], "not found"),
    (lambda d: ["--model", str(d)], "no config.json"),
    (lambda d: ["--prompts", str(d / "nope.jsonl")], "prompt file not found"),
    (lambda d: ["--prompts", _write(d, "bad.jsonl", '{"id": "r1", "prompt": "x"}\n{not json\n')], "bad.jsonl:2"),
    (lambda d: ["--prompts", _write(d, "empty.jsonl", '{"id": "r1", "prompt": ""}\n')], "empty"),
    (lambda d: ["--prompts", _write(d, "keys.jsonl", '{"id": "r1", "text": "x"}\n')], "unknown key"),
    (lambda d: ["--prompts", _write(d, "long.jsonl", json.dumps({"id": "r1", "tokens": [1] * 5000}) + "\n")],
     "context"),
    (lambda d: ["--policy", "fastest"], "unknown kernel policy"),
    (lambda d: ["--schedules", "serial,sideways"], "unknown schedule"),
])
def test_run_bad_input(tmp_path, capsys, make, needle):
    out = tmp_path / "out"
    rc, _, err = run(["run", *make(tmp_path), "--out", str(out), "--max-tokens", "4"], capsys)
    assert rc == 2
    assert len(err) == 1 and needle in err[0], err
    assert not list(out.glob("*.h5")) if out.exists() else True


def _write(d, name, text):
    p = d / name
    p.write_text(text)
    return str(p)


def test_unknown_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    rc, _, err = run(["run", "--model", str(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and len(err) == 1 and "gpt2" in err[0] and "llama" in err[0]


def test_a_failed_run_keeps_the_previous_traces(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "serial.h5").write_bytes(b"previous")
    remember_outputs([out / "serial.h5"], command="run")  # an earlier run's (else refused as another's file)
    rc, _, _ = run(["run", "--policy", "nope", "--out", str(out)], capsys)
    assert rc == 2 and (out / "serial.h5").read_bytes() == b"previous"


def test_usage_errors_are_one_line(capsys):
    rc, _, err = run(["diff", "only-one.h5"], capsys)
    assert rc == 2 and len(err) == 1
    rc, _, err = run(["replay", "x.h5", "--force", "seven:gemv"], capsys)
    assert rc == 2 and len(err) == 1


def test_probe_and_sweep_bad_input(capsys):
    rc, _, err = run(["probe", "--rows", "0..9"], capsys)
    assert rc == 2 and "rows" in err[0]
    rc, _, err = run(["sweep", "-n", "0"], capsys)
    assert rc == 2 and "at least one run" in err[0]


def test_a_closed_pipe_is_no_traceback():
    """`divergence bisect A B --json | head -1`: the reader leaves early; no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    traces = Path(__file__).parents[2] / "traces" / "v1"
    cmd = (f"{sys.executable} -m divergence bisect {traces / 'serial.h5'} {traces / 'concurrent.h5'} --json"
           " | head -c 10")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("{")
    assert "Traceback" not in out.stderr, out.stderr

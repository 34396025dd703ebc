"""Every command returns the exit codes its --help documents (issue 32): 0 success, 1 a
compared pair diverged, 2 bad input, on the embedded demo and on bad input. And what a
newcomer meets on the way: --version, defaults in --help, progress only on a terminal."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import divergence
from divergence.cli.main import SUBCOMMANDS, main

EXAMPLE = Path(__file__).parents[2] / "examples" / "toy_engine.py"


def run(args, capsys):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def documented(command: str, capsys) -> set[int]:
    """The exit codes `divergence COMMAND --help` lists under 'exit codes:'."""
    rc, out, _ = run([command, "--help"], capsys)
    assert rc == 0
    assert "exit codes:" in out, out
    return {int(m) for m in re.findall(r"^  ([0-9])  ", out.split("exit codes:", 1)[1], re.M)}


def pipe_clean(err: str) -> None:
    """What a pipe or a CI log gets on stderr: no carriage returns, no blank lines."""
    assert "\r" not in err, repr(err)
    lines = err.split("\n")
    if lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    assert all(line.strip() for line in lines), repr(err)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`divergence run --check` of the embedded demo, once: its schedules diverge (r1 at position 127)."""
    out = tmp_path_factory.mktemp("demo")
    import contextlib  # (capsys is function-scoped: capture by hand)
    import io

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()) as stdout, contextlib.redirect_stderr(err):
        rc = main(["run", "--out", str(out), "--check"])
    return {"rc": rc, "out": stdout.getvalue(), "err": err.getvalue(),
            "a": out / "serial.h5", "b": out / "concurrent.h5"}


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"divergence {divergence.__version__}"


def test_every_command_documents_its_exit_codes(capsys):
    for command in SUBCOMMANDS:
        codes = documented(command, capsys)
        assert 0 in codes and 2 in codes, (command, codes)
    for command in ("run", "diff", "bisect", "report", "replay"):  # they compare a pair
        assert 1 in documented(command, capsys), command


@pytest.mark.parametrize("command, needles", [
    ("run", ["--token-budget TOKEN_BUDGET", "(default: 256)", "(default: 8)", "(default: serial,concurrent)",
             "model's own", "--temperature", "--top-p", "--seed", "a directory"]),
    ("sweep", ["the prompt to repeat (text) (default: Return the number of)", "largest batch (default 8)"]),
    ("replay", ["per-seq", "batched", "padded", "solo", "unsharded", "gemv", "threshold:N", "lm_head",
                "one file"]),
    ("import", ["one file"]),
])
def test_help_shows_defaults_and_names(command, needles, capsys):
    _, out, _ = run([command, "--help"], capsys)
    flat = " ".join(out.split())
    for n in needles:
        assert n in flat, (n, out)


def test_sweep_help_is_plain(capsys):
    _, out, _ = run(["sweep", "--help"], capsys)
    assert "anchors" not in out


def test_run_check_diverged_is_1_and_pipe_clean(demo, capsys):
    assert demo["rc"] == 1 and 1 in documented("run", capsys)
    assert "diverged: r1 at position" in demo["out"]
    pipe_clean(demo["err"])


def test_run_identical_is_0_and_bad_input_2(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "r1", "prompt": "Return the number of", "max_tokens": 2}) + "\n")
    # in a real pipe (capsys does not show what rich's bar leaves there: blank lines)
    p = subprocess.run([sys.executable, "-m", "divergence", "run", "--prompts", str(prompts), "--schedules",
                        "serial,concurrent", "--spec-k", "0", "--out", str(tmp_path / "t")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "identical" in p.stdout
    pipe_clean(p.stderr)
    rc, _, err = run(["run", "--top-k", "0", "--out", tmp_path / "u"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--seed", "1.5"], "--seed: invalid int value"),  # any integer is a seed (-3 too: docs/prompts.md)
])
def test_run_sampling_defaults_are_checked(argv, needle, tmp_path, capsys):
    rc, _, err = run(["run", *argv, "--out", tmp_path / "t"], capsys)
    assert rc == 2 and needle in err, err


def test_run_sampling_defaults_apply_where_a_line_sets_none(tmp_path):
    from divergence.workloads.prompts import load_prompts, sampling_defaults

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "a", "tokens": [1, 2]}) + "\n"
                 + json.dumps({"id": "b", "tokens": [1, 2], "temperature": 0.5, "seed": 7}) + "\n")
    d = sampling_defaults(temperature=0.8, top_p=0.9, seed=3)
    a, b = load_prompts(p, None, sampling=d)
    assert (a.sampling.temperature, a.sampling.top_p, a.sampling.seed) == (0.8, 0.9, 3)
    assert (b.sampling.temperature, b.sampling.top_p, b.sampling.seed) == (0.5, 0.9, 7)


def test_run_temperature_reaches_the_trace(tmp_path, capsys):
    from divergence.trace.reader import Trace

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "r1", "prompt": "Return the number of", "max_tokens": 2}) + "\n")
    rc, out, err = run(["run", "--prompts", prompts, "--schedules", "serial", "--spec-k", "0", "--temperature",
                        "0.7", "--seed", "11", "--out", tmp_path / "t"], capsys)
    assert rc == 0, err
    with Trace.open(tmp_path / "t" / "serial.h5") as t:
        (req,) = t.requests
        assert (req.sampling.temperature, req.sampling.seed) == (pytest.approx(0.7), 11)


def test_diff(demo, capsys):
    codes = documented("diff", capsys)
    assert run(["diff", demo["a"], demo["b"]], capsys)[0] == 1 in codes
    assert run(["diff", demo["a"], demo["a"]], capsys)[0] == 0 in codes
    assert run(["diff", demo["a"], demo["a"].parent / "nope.h5"], capsys)[0] == 2 in codes


def test_bisect(demo, capsys):
    codes = documented("bisect", capsys)
    assert run(["bisect", demo["a"], demo["b"]], capsys)[0] == 1 in codes
    assert run(["bisect", demo["a"], demo["a"]], capsys)[0] == 0 in codes
    assert run(["bisect", demo["a"], demo["a"].parent / "nope.h5"], capsys)[0] == 2 in codes


def test_report(demo, tmp_path, capsys):
    codes = documented("report", capsys)
    rc, _, err = run(["report", demo["a"], demo["b"], "--html", tmp_path / "d.html"], capsys)
    assert rc == 1 in codes and (tmp_path / "d.html").exists()  # diverged: 1, and the page is written
    assert run(["report", demo["a"], demo["a"], "--html", tmp_path / "s.html"], capsys)[0] == 0 in codes
    assert run(["report", demo["a"], demo["b"]], capsys)[0] == 2 in codes  # no --html


def test_replay(demo, capsys):
    codes = documented("replay", capsys)
    a, b = demo["a"], demo["b"]
    # unforced: faithful to B, and so it proves nothing against A (r1 still diverges where it did)
    rc, out, err = run(["replay", b, "--against", a], capsys)
    assert rc == 1 in codes, out
    assert "faithful" in out and "still diverges from serial, at position 127" in out, out
    pipe_clean(err)
    # forced on serial's kernel at the root-cause step: what changed, and what that proved
    rc, out, err = run(["replay", b, "--force", "8:gemv", "--against", a], capsys)
    assert rc == 0 in codes, out
    assert "differs: tokens equal" not in out and "changed from the original" in out, out
    assert "r1  tokens from position 127" in out, out
    assert "r1  now matches serial up to position 127, where the original diverged" in out, out
    rc, out, _ = run(["replay", b, "--force", "8:gemv", "--against", a, "--json"], capsys)
    j = json.loads(out)
    assert {"faithful", "tokens_equal", "forced", "out"} <= set(j)  # replay's keys stay
    assert j["against"]["proved"] is True and j["against"]["requests"][0]["original_position"] == 127
    assert run(["replay", b, "--force", "99999:gemv"], capsys)[0] == 2 in codes
    assert run(["replay", b, "--against", a.parent / "nope.h5"], capsys)[0] == 2 in codes


def test_browse(demo, capsys, monkeypatch):
    from divergence.tui import app as app_module

    codes = documented("browse", capsys)
    monkeypatch.setattr(app_module.BrowseApp, "run", lambda self, *a, **k: None)  # the user quits at once
    assert run(["browse", demo["a"], demo["b"]], capsys)[0] == 0 in codes
    assert run(["browse", demo["a"].parent / "nope.h5"], capsys)[0] == 2 in codes


def test_sweep(capsys):
    codes = documented("sweep", capsys)
    rc, out, err = run(["sweep", "-n", "2", "--max-tokens", "2"], capsys)
    assert rc == 0 in codes and "unique completion" in out
    pipe_clean(err)
    assert run(["sweep", "-n", "0"], capsys)[0] == 2 in codes


def test_probe(capsys):
    codes = documented("probe", capsys)
    assert run(["probe", "--rows", "1..2", "--kv-lens", "8", "--no-cache"], capsys)[0] == 0 in codes
    assert run(["probe", "--rows", "1,,2"], capsys)[0] == 2 in codes


def test_import(tmp_path, capsys):
    codes = documented("import", capsys)
    src = tmp_path / "serial"
    subprocess.run([sys.executable, str(EXAMPLE), "--schedule", "serial", "--out", str(src)], check=True,
                   timeout=120)
    assert run(["import", src, "--out", tmp_path / "s.h5"], capsys)[0] == 0 in codes
    assert run(["import", tmp_path / "nope", "--out", tmp_path / "n.h5"], capsys)[0] == 2 in codes


def test_the_global_reference_blas_option_is_taken_after_the_subcommand_too(tmp_path):
    """`divergence run --reference-blas` (the docs' spelling) runs on the reference BLAS, as
    `divergence --reference-blas run` does (it was 'unrecognized arguments')."""
    p = subprocess.run([sys.executable, "-m", "divergence", "run", "--reference-blas", "--schedules", "serial",
                        "--max-tokens", "2", "--out", str(tmp_path / "r")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "BLAS: reference BLAS bundled with MLX" in p.stderr, p.stderr

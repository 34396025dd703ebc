"""How a cause was confirmed, said everywhere (issue 28): `--json` (root_cause.confirmed_by),
the text report and the HTML page's badge name the way (this engine's replay, the user's
command) and a lead left unconfirmed gets a hint naming a command that works on its traces:
--confirm for this engine's, --confirm-cmd for another engine's (which --confirm refuses)."""
from __future__ import annotations

import json
import shlex
import sys

import pytest

from divergence.analysis.bisect import bisect_traces
from divergence.analysis.cause import BY_COMMAND, BY_REPLAY, CONFIRMED_BY
from divergence.analysis.confirmation import BaseConfirmer, Confirmation
from divergence.analysis.html import render_html
from divergence.analysis.report import render_bisect
from divergence.cli.main import main
from divergence.trace.reader import Trace

from record.conftest import EXAMPLE, toy_pair  # noqa: E402  (tests/ is on sys.path)
from tui import story  # noqa: E402


class NothingToForce(BaseConfirmer):
    def confirm(self, cause, rd) -> Confirmation:
        return Confirmation(None, "nothing to force")


def _bisect_json(args, capsys) -> dict:
    capsys.readouterr()
    assert main(["bisect", *args, "--json"]) == 1
    return json.loads(capsys.readouterr().out)


def _text(args, capsys) -> str:
    capsys.readouterr()
    assert main(["bisect", *args]) == 1
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy engine's pair (another engine's traces: settings.engine is set)."""
    return tuple(str(p) for p in toy_pair(tmp_path_factory.mktemp("toy")))


def _cmd(args: str) -> str:
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(EXAMPLE))} --schedule concurrent {args} --out {{out}}"


def test_a_confirm_cmd_confirmation_says_it_was_the_users_command(toy, capsys, tmp_path):
    args = [*toy, "--confirm-cmd", _cmd("--split-step {step}")]
    r1 = _bisect_json(args, capsys)["requests"][0]
    assert r1["confirmed"] is True and r1["root_cause"]["confirmed_by"] == BY_COMMAND
    text = _text(args, capsys)
    assert f"      confirmed by: {CONFIRMED_BY[BY_COMMAND]}" in text, text
    assert "this engine's replay" not in text
    page = tmp_path / "r.html"
    assert main(["report", *args, "--html", str(page)]) == 1
    html = page.read_text()
    assert "confirmed by your command (--confirm-cmd)</span>" in html
    assert "confirmed by replay" not in html and "the replay forced" not in html


def test_a_failed_confirm_cmd_is_not_confirmed_by_the_command(toy, capsys, tmp_path):
    args = [*toy, "--confirm-cmd", _cmd("--split-step 0")]
    r1 = _bisect_json(args, capsys)["requests"][0]
    assert r1["confirmed"] is False and r1["root_cause"]["confirmed_by"] == BY_COMMAND
    assert f"      tried: {CONFIRMED_BY[BY_COMMAND]}" in _text(args, capsys)
    page = tmp_path / "r.html"
    assert main(["report", *args, "--html", str(page)]) == 1
    assert "NOT confirmed by your command (--confirm-cmd)</span>" in page.read_text()


def test_another_engines_lead_is_hinted_to_confirm_cmd_not_confirm(toy, capsys, tmp_path):
    r1 = _bisect_json(list(toy), capsys)["requests"][0]
    assert r1["root_cause"]["confirmed_by"] is None and r1["confirmed"] is None
    page = tmp_path / "r.html"
    assert main(["report", *toy, "--html", str(page)]) == 1
    html = page.read_text()
    assert "not confirmed (run with --confirm-cmd CMD" in html and "a lead only" in html
    assert "run with --confirm to" not in html and f"{toy[1]} --confirm-cmd CMD" in html
    assert "--confirm " not in html.replace("--confirm-cmd", "")
    with Trace.open(toy[0]) as a, Trace.open(toy[1]) as b:
        text = render_bisect(bisect_traces(a, b), foreign=True)
    assert "    a lead only, not proved by a re-run; to prove it: divergence bisect" in text
    assert f"{toy[1]} --confirm-cmd CMD" in text and " --confirm\n" not in text and " --confirm (" not in text


def test_this_engines_lead_is_hinted_to_confirm(tmp_path):
    pa, pb = story.write_pair(tmp_path)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        rep = bisect_traces(a, b)
        html, text = render_html(rep, a, b), render_bisect(rep, foreign=False)
    assert "not confirmed (run with --confirm to replay it): a lead only" in html
    assert f"to confirm it: divergence bisect {pa} {pb} --confirm" in html and "--confirm-cmd" not in html
    assert text.count(f"    a lead only, not proved by a re-run; to prove it: divergence bisect {pa} {pb} --confirm\n") == 1
    assert "confirmed" not in text  # a report that asked for no confirmation does not speak of one


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert main(["run", "--out", str(out), "--json"]) == 0
    return str(out / "serial.h5"), str(out / "concurrent.h5")


def test_the_demo_pair_is_confirmed_by_this_engines_replay_with_as_kernels(demo, capsys, tmp_path):
    args = [*demo, "--confirm"]
    r1 = next(r for r in _bisect_json(args, capsys)["requests"] if r["id"] == "r1")
    assert r1["confirmed"] is True and r1["root_cause"]["confirmed_by"] == BY_REPLAY
    text = _text(args, capsys)
    assert f"      confirmed by: {CONFIRMED_BY[BY_REPLAY]}" in text, text
    page = tmp_path / "r.html"
    assert main(["report", *args, "--html", str(page)]) == 1
    html = page.read_text()
    assert "<span class='confirm yes'>confirmed by replay</span>" in html
    assert "how: this engine&#x27;s replay of B with the step&#x27;s kernels forced to A&#x27;s (--confirm)" in html


def test_a_confirmation_asked_for_that_could_not_run_is_not_told_to_run_it(tmp_path):
    pa, pb = story.write_pair(tmp_path)
    with Trace.open(pa) as a, Trace.open(pb) as b:
        rep = bisect_traces(a, b, confirm=True, confirmer=NothingToForce())
        html, text = render_html(rep, a, b), render_bisect(rep, foreign=False)
    assert "<span class=note>not confirmed, a lead only</span>: nothing to force" in html
    assert "run with --confirm" not in html and "to confirm it:" not in html
    assert "    not confirmed (nothing to force): a lead only" in text

"""A command that re-runs itself in a child (a replay under the recorded BLAS environment, run
--blas-core) shows the child's output where the caller looks: through sys.stdout / sys.stderr
when main() is called in-process with its output captured (capsys), on the file descriptors
otherwise. Before, an in-process caller under another BLAS than the trace's got nothing
(tests/analysis/test_scenarios.py's schema-1 replay failed under DIVERGENCE_BLAS=reference)."""
from __future__ import annotations

import os
import sys

from divergence.cli.reexec import call_child

CHILD = [sys.executable, "-c", "import sys; print('report'); print('note', file=sys.stderr); sys.exit(3)"]


def test_captured_streams_get_the_childs_output(capsys):
    assert call_child(CHILD, env=dict(os.environ)) == 3
    cap = capsys.readouterr()
    assert (cap.out, cap.err) == ("report\n", "note\n")


def test_file_descriptors_get_it_directly(capfd):
    assert call_child(CHILD, env=dict(os.environ)) == 3
    cap = capfd.readouterr()
    assert (cap.out, cap.err) == ("report\n", "note\n")

"""Under --divergence-artifacts, a failure's "To reproduce" names the kept copies of the
traces, not the temporary ones they were copied from (issue 32)."""
from __future__ import annotations


def test_direct_assertion_reproduces_from_the_artifacts(pytester, run, header):
    pytester.makepyfile(test_direct=header + """
from divergence.testing import assert_reproducible

def test_direct(tmp_path):
    assert_reproducible(None, PROMPTS, policy="threshold:1", max_tokens=FEW_TOKENS, confirm=False,
                        out_dir=tmp_path / "temporary")
""")
    result = run("--divergence-artifacts", "out/ci")
    result.assert_outcomes(failed=1)
    art = pytester.path / "out" / "ci" / "test_direct.py__test_direct"
    result.stdout.fnmatch_lines([
        "E *To reproduce:",
        f"E *    serial:      {art}/serial.h5",
        f"E *    concurrent:  {art}/concurrent.h5",
        f"E *    divergence bisect {art}/serial.h5 {art}/concurrent.h5 --confirm",
        f"E *    divergence browse {art}/serial.h5 {art}/concurrent.h5",
    ])
    reproduce = result.stdout.str().split("To reproduce:", 1)[1].split("- divergence artifacts -", 1)[0]
    assert "temporary" not in reproduce, reproduce

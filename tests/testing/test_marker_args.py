"""The `reproducible` marker's arguments are checked as the ini keys are (issue 49): each bad one,
including those that only the model can judge (top_k against its vocabulary, a prompt against
its context and token ids), fails the test with the plugin's one line, never with a traceback
from inside divergence, and never passes by taking a value for something else."""
from __future__ import annotations

import pytest

from divergence.testing.models import make_random_model

MARKS = {
    "top_k_past_the_vocabulary": ("top_k=5000, model=SMALL", "top_k 5000 is larger than the model's vocabulary "
                                                              "(512 tokens)"),
    "top_k_past_the_fixture_vocabulary": ("top_k=1025", "top_k 1025 is larger than the model's vocabulary (1024 tokens)"),
    "top_k_true": ("top_k=True", "top_k must be an integer >= 1, got True"),
    "max_tokens_fraction": ("max_tokens=2.5", "max_tokens must be an integer >= 1, got 2.5"),
    "max_tokens_past_the_context": ("max_tokens=5000", "exceeds the model's context of 2048 tokens"),
    "token_budget_zero": ("token_budget='0'", "token_budget must be an integer >= 1, got '0'"),
    "spec_k_negative": ("spec_k=-1", "spec_k must be an integer >= 0, got -1"),
    "policy_unknown": ("policy='fast'", "unknown kernel policy 'fast' (expected native | batch-invariant | threshold:N)"),
    "confirm_maybe": ("confirm='maybe'", "confirm must be true or false, got 'maybe'"),
    "bitwise_number": ("bitwise=2", "bitwise must be true or false, got 2"),
    "stop_at_eos_maybe": ("stop_at_eos='maybe'", "stop_at_eos must be true or false, got 'maybe'"),
    "token_past_the_vocabulary": ("prompts=[[1, 5000]]", "outside the vocabulary (0..1023)"),
    "schedule_unknown": ("schedules=['serial', 'fast']", "unknown schedule 'fast'"),
    "dtype_unknown": ("dtype='float8'", "dtype must be float32, float16 or bfloat16, got 'float8'"),
}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A model whose head has 512 rows (the fixture tokenizer's first 512 tokens)."""
    return make_random_model(tmp_path_factory.mktemp("small") / "v512", vocab_size=512, seed=3)


def test_bad_marker_arguments_fail_with_the_plugins_one_line(pytester, run, small_model):
    body = ["import pytest", f"SMALL = {str(small_model)!r}"]
    for name, (args, _) in MARKS.items():
        prompts = "" if "prompts=" in args else "prompts=['Return the number of'], "
        body += ["", f"@pytest.mark.reproducible({prompts}max_tokens=2, {args})" if "max_tokens" not in args else
                 f"@pytest.mark.reproducible({prompts}{args})", f"def test_{name}():", "    pass"]
    pytester.makepyfile(test_marks="\n".join(body) + "\n")
    result = run("-rf")
    result.assert_outcomes(failed=len(MARKS))
    out = result.stdout.str()
    for name, (_, message) in MARKS.items():
        lines = [x for x in out.splitlines() if x.startswith(f"FAILED test_marks.py::test_{name} ")]
        assert len(lines) == 1, (name, lines)
        after = out.split(f"_ test_{name} _")[1].splitlines()[1:]
        body_lines = []
        for x in after:  # the failure's text: up to the next section's or the summary's rule
            if x.startswith(("_", "=")):
                break
            body_lines += [x] if x.strip() else []
        assert len(body_lines) == 1 and body_lines[0].startswith("divergence: @pytest.mark.reproducible: "), \
            (name, body_lines)
        assert message in body_lines[0], (name, body_lines)
    assert "Traceback" not in out and "assertions.py" not in out and "runner.py" not in out

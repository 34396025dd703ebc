"""`--policy native` on a backend whose kernels depend on the row count.

Every trace step says `native`, so kernel labels cannot explain anything: the
probed native class of each (step, op) and replaying a step request by request
(`STEP:solo`) must. Two backends:

- a stand-in backend (monkeypatched `kernels.run_native`): one row at a time up
  to 4 rows, a split-K GEMM above, like a GPU's GEMV/GEMM switch. With the seed-000
  demo it diverges exactly like threshold:4, but under the `native` label;
- the real CPU backend with the optimized BLAS `.ci/run` installs (OpenBLAS), whose
  fp32 sgemm is row-count dependent: concurrent logits differ from serial, and a
  replay that runs every concurrent step request by request gives serial's bits.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from divergence import Trace
from divergence.cli.main import main
from divergence.engine.kernels import linear as kernels


def _gpu_like_native(x, op):
    m = x.shape[0]
    if m <= 4:
        return kernels.run_gemv(x, op)
    group = op.module.group_size if op.quantized else 1
    return kernels.run_gemm(x, op, kernels.gemm_splits(m, op.n, op.k, group=group))


@pytest.fixture(scope="module")
def gpu_like(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(kernels, "run_native", _gpu_like_native)
    out = tmp_path_factory.mktemp("native")
    try:
        assert main(["run", "--policy", "native", "--out", str(out), "--json"]) in (0, 1)
        yield out
    finally:
        mp.undo()


def test_native_traces_record_kernel_classes(gpu_like):
    with Trace.open(gpu_like / "concurrent.h5") as b:
        ks = b.kernels()
        attn = ks["op"] == "attention"
        assert set(ks["kernel"][~attn]) == {"native"}
        # attention: batched where a step holds several decode slices, per sequence otherwise
        assert set(ks["kernel"][attn]) == {"per-seq", "batched"}
        cls = np.asarray(ks["native_class"])
        assert (cls[~attn] != 0).all()
        rows = np.asarray(ks["rows"])
        k_proj = (ks["op"] == "k_proj") & (ks["model"] == "target")
        # up to 4 rows the stand-in runs row by row: one class; the 158-row step is another
        small = set(cls[k_proj & (rows <= 4)])
        assert len(small) == 1
        assert (k_proj & (rows > 4)).any() and set(cls[k_proj & (rows > 4)]).isdisjoint(small)


def test_bisect_names_the_class_change_and_solo_replay_confirms(gpu_like, capsys):
    capsys.readouterr()
    rc = main(["bisect", str(gpu_like / "serial.h5"), str(gpu_like / "concurrent.h5"), "--confirm", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    r1 = next(r for r in report["requests"] if r["id"] == "r1")
    assert r1["status"] == "diverged"
    cause = r1["root_cause"]
    assert cause["kind"] == "cache_contamination"
    assert cause["kernel_a"] == cause["kernel_b"] == "native"
    assert cause["rows_a"] == 4 and cause["rows_b"] > 120
    assert cause["op"] == "k_proj"
    assert set(cause["native_class_changes"]) >= {"q_proj", "k_proj", "v_proj"}
    assert cause["native_class_changes"]["k_proj"] == {"rows_a": 4, "rows_b": cause["rows_b"]}
    assert r1["confirmed"] is True, cause["confirm_detail"]
    assert "request by request" in cause["confirm_detail"]
    # and in words
    main(["bisect", str(gpu_like / "serial.h5"), str(gpu_like / "concurrent.h5")])
    text = capsys.readouterr().out
    assert "native kernel class changed" in text and "k_proj" in text


def test_solo_force_is_a_whole_step_mode(gpu_like, capsys):
    from divergence.analysis.replayer import parse_force
    from divergence.core.policy import SOLO
    from divergence.errors import PolicyError

    assert parse_force(["8:solo"]) == {8: SOLO}
    with pytest.raises(PolicyError, match="whole step"):
        parse_force(["8:k_proj=solo"])
    capsys.readouterr()
    assert main(["replay", str(gpu_like / "concurrent.h5"), "--force", "8:k_proj=solo"]) == 2
    assert "whole step" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cpu_native_fp32(tmp_path_factory):
    """Random fp32 model, 8 prompts prefilled together: the packed prefill (~70 rows)
    and 8-row decode steps hit other sgemm paths than serial's."""
    from divergence.testing.models import make_random_model
    from divergence.fixtures import TARGET

    root = tmp_path_factory.mktemp("cpu-native")
    model = make_random_model(root / "model", hidden_size=256, num_layers=2, heads=4, kv_heads=2,
                              intermediate_size=512, dtype="float32", tokenizer_from=TARGET)
    prompts = root / "prompts.jsonl"
    texts = ["The socket module provides", "Return the number of", "This function is deprecated since",
             "Create a new thread", "Raise an exception if the", "The default encoding is",
             "Open the file and", "If the argument is omitted"]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t, "max_tokens": 12}) + "\n"
                               for i, t in enumerate(texts)))
    out = root / "traces"
    assert main(["run", "--model", str(model), "--spec-k", "0", "--policy", "native", "--prompts", str(prompts),
                 "--ignore-eos", "--out", str(out), "--json"]) in (0, 1)
    return out


@pytest.mark.blas
def test_cpu_blas_native_divergence_is_undone_by_solo_replay(cpu_native_fp32):
    from divergence.analysis.diff import diff_traces
    from divergence.analysis.replayer import Replayer, fidelity, parse_force
    from divergence.trace.writer import TraceWriter

    with Trace.open(cpu_native_fp32 / "serial.h5") as a, Trace.open(cpu_native_fp32 / "concurrent.h5") as b:
        if "OpenBLAS" in str(a.meta["environment"].get("blas", "")):
            # the optimized BLAS is row-count dependent: batching moves the logits
            assert any(r.first_numeric_divergence is not None for r in diff_traces(a, b).requests)
        forced = parse_force([f"{p.index}:solo" for p in b.iter_plans()])
        out = cpu_native_fp32 / "solo.h5"
        with TraceWriter(out, top_k=b.meta["settings"]["top_k"], kv_hashes=True) as w:
            Replayer().run(b, forced=forced, observers=[w])
        with Trace.open(out) as r:
            rep = fidelity(a, r, {}, 0.0, None)
            assert rep.tokens_equal and rep.logits_equal, rep.first_difference


def test_browser_labels_native_kernels_with_their_class(gpu_like):
    from divergence.tui.data import B, BrowseData

    data = BrowseData.open(gpu_like / "serial.h5", gpu_like / "concurrent.h5")
    try:
        idx = data.steps(B)
        idx.load_kernels()
        big = idx.row(idx.row_of_step(8))  # r1 verify + r2 prefill: 158 rows
        assert big.rows > 120
        with Trace.open(gpu_like / "concurrent.h5") as b:
            small_step = next(p.index for p in b.iter_plans() if p.model == "target" and p.rows == 4)
        small = idx.row(idx.row_of_step(small_step))
        tags = []
        for label in (big.kernels["attn"], small.kernels["attn"]):
            attention, tag = label.split()  # the step's attention kernel, then the linear ops' class tag
            assert attention in ("per-seq", "batched")
            assert tag.startswith("native/") and len(tag) == len("native/") + 4
            tags.append(tag)
        assert tags[0] != tags[1]  # another kernel class
    finally:
        data.close()

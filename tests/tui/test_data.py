"""The browser's data layer: numpy over the traces, no textual."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from divergence.errors import TraceError, TraceMismatchError
from divergence.trace.reader import Trace
from divergence.tui.data import A, B, BrowseData, fmt_logit, show_piece


@pytest.fixture
def pair(story_pair):
    d = BrowseData.open(*story_pair)
    d.analyse()
    yield d
    d.close()


def test_the_data_layer_does_not_import_textual():
    import subprocess

    code = "import sys, divergence.tui.data; print('textual' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_request_rows_name_the_story(pair):
    rows = {r.id: r for r in pair.request_rows()}
    assert rows["r1"].diverged and rows["r1"].status_text() == "diverged at 14 (#8)"
    assert rows["r1"].numeric_text() == "10"
    assert rows["r1"].cause.b.step == 3 and rows["r1"].cause.layer == 0
    assert "cache contamination L0 @ step 3" == rows["r1"].cause_text()
    assert rows["r2"].status == rows["r3"].status == "identical"


def test_tokens_aligned_and_marked(pair, story_pair):
    al = pair.tokens("r1")
    assert al.prompt_len == 6 and len(al) == 24
    assert int(al.positions[al.first_divergent]) == 14 and int(al.positions[al.first_numeric]) == 10
    assert not al.differs[: al.first_divergent].any() and al.differs[al.first_divergent:].all()
    assert al.numeric[al.first_numeric: al.first_divergent].all() and not al.numeric[: al.first_numeric].any()
    with Trace.open(story_pair[0]) as t:
        rec = t.tokens("r1")
        assert np.array_equal(al.tokens[A], rec.tokens)
        np.testing.assert_array_equal(al.margins[A], rec.topk_logits[:, 0].astype(np.float64) - rec.topk_logits[:, 1])
    assert al.max_delta(0) == 0.0 and al.max_delta(al.first_numeric) > 0


def test_topk_is_exact(pair, story_pair):
    al = pair.tokens("r1")
    tk = pair.topk("r1", al.first_divergent)
    for side, path in zip(tk.sides, story_pair):
        with Trace.open(path) as t:
            rec = t.tokens("r1")
            i = int(np.flatnonzero(rec.positions == 14)[0])
            assert side.ids == rec.topk_ids[i].tolist()
            assert np.array_equal(np.array(side.logits, np.float32).view(np.uint32), rec.topk_logits[i].view(np.uint32))
            assert side.token == int(rec.tokens[i]) and side.step == int(rec.steps[i])
            # the text shown reads back to the same float32 bits
            assert all(np.float32(fmt_logit(x)) == np.float32(x) for x in rec.topk_logits[i])
    a, b = tk.sides
    j = b.ids.index(a.ids[0])
    assert a.deltas[0] == pytest.approx(a.logits[0] - b.logits[j], abs=0)


def test_steps_and_kernels(pair):
    idx = pair.steps(B)
    assert len(idx) == 24
    row = idx.row_of_step(3)
    assert idx.row(row).composition == "r2 prefill[0:40] + r1 decode[8:9]"
    assert idx.row(row).kernels is None  # not read yet
    idx.load_kernels()
    assert idx.row(row).kernels == {"attn": "gemm/4", "mlp": "gemm/4", "head": "gemm/4"}
    det = pair.step_detail(B, row)
    assert [(m.request_id, m.root) for m in det.marks] == [("r1", True)]
    assert "root cause of r1" in det.marks[0].text
    assert {k.op for k in det.kernels} >= {"k_proj", "lm_head"}
    assert list(idx.steps_of("r2")) == list(range(3, 11))


def test_kv_grid_finds_the_contaminated_cell(pair):
    g = pair.kv_grid("r1", pair.kv_default_steps("r1"))
    assert g.earliest == (0, 8)
    assert int(g.step[B, 0, 8]) == 3 and int(g.step[A, 0, 8]) == 3
    assert g.differs[:, 8].all() and not g.differs[:, :8].any()
    end = pair.kv_grid("r1")
    assert end.differs.sum() > g.differs.sum()


def test_one_trace(story_pair):
    d = BrowseData.open(story_pair[0])
    try:
        assert not d.two and d.analysed
        assert d.request_rows()[0].len_a is None  # not read before count_tokens
        d.count_tokens()
        rows = d.request_rows()
        assert [r.status for r in rows] == ["", "", ""] and rows[0].len_a == 24 and rows[0].len_b is None
        al = d.tokens("r1")
        assert al.first_divergent is None and not al.differs.any()
        assert d.topk("r1", 0).sides[0].deltas == [None] * 4
        assert d.kv_grid("r1").earliest is None
    finally:
        d.close()


def test_bad_input(tmp_path, story_pair, other_model_trace):
    with pytest.raises(TraceError):
        BrowseData.open(tmp_path / "missing.h5")
    with pytest.raises(TraceMismatchError):
        BrowseData.open(story_pair[0], other_model_trace)


def test_show_piece():
    assert show_piece(" the") == "␣the"
    assert show_piece("a\nb\tc\x00") == "a⏎b⇥c\\x00"
    assert show_piece(None) == ""


def test_step_list_names_the_attention_kernel(target, tmp_path):
    """A native run: the attn column shows the step's attention kernel next to the native tag."""
    from divergence.core.request import Request
    from divergence.engine.engine import Engine
    from divergence.trace.writer import TraceWriter
    from divergence.tui.data.steps import StepIndex

    path = tmp_path / "native.h5"
    reqs = [Request(f"r{i}", tuple(target.encode(p)), max_tokens=3) for i, p in enumerate(("If the", "Open a"))]
    with TraceWriter(path, top_k=4) as w:
        Engine(target, policy="native", stop_at_eos=False, observers=[w]).run(reqs, "concurrent")
    with Trace.open(path) as t:
        idx = StepIndex(t)
        idx.load_kernels()
        attn = [idx.row(r).kernels["attn"] for r in range(len(idx))]
    assert any(a.startswith("batched") for a in attn) and any(a.startswith("per-seq") for a in attn), attn


def test_overview_shows_the_blas_thread_count():
    from types import SimpleNamespace

    from divergence.tui.data.overview import meta_rows

    def trace(env):
        meta = {"schedule": "serial", "policy": "native", "model": {"path": "/m/target"}, "draft": None,
                "settings": {}, "environment": env}
        return SimpleNamespace(meta=meta, tp_degree=1)
    rows = dict(meta_rows([trace({"blas": "OpenBLAS", "blas_threads": 2}), trace({"blas": "OpenBLAS"})]))
    assert rows["BLAS"] == ["OpenBLAS · 2 threads", "OpenBLAS"]

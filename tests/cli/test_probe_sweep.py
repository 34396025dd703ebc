"""probe maps row-count classes; sweep counts unique completions."""
from __future__ import annotations

import json

import mlx.core as mx
import pytest

from divergence.cli.main import main
from divergence.engine.kernels.dispatch import KernelDispatcher, KernelPolicy
from divergence.core.classes import OpProbe, classify
from divergence.workloads.probe import probe_linear


def test_classify_groups_by_bits():
    import numpy as np

    a, b = np.array([1, 2], np.uint16), np.array([1, 3], np.uint16)
    assert classify([a, a, b, b, a]) == [0, 0, 1, 1, 0]
    p = OpProbe("q_proj", "8x8", "bfloat16", [1, 2, 3, 8, 9], [0, 0, 0, 1, 1])
    assert p.describe() == "rows 1..3 = M=1, 8..9 class 1"
    q = OpProbe("q_proj", "8x8", "float32", [1, 2, 13, 14, 15], [0, 0, 1, 2, 1])
    assert q.describe() == "rows 1..2 = M=1, 13..15 differ (2 classes)"


def test_probe_finds_the_split_of_the_engines_own_gemm(target):
    """threshold:4 runs gemv up to 4 rows and split-K gemm above: the probe must see it."""
    from divergence.engine.model.forward import PackedForward

    op = PackedForward(target).ops[0].q
    disp = KernelDispatcher(KernelPolicy.parse("threshold:4"), "target")
    rows = list(range(1, 13))
    classes = probe_linear(op, rows, mx.bfloat16, run=lambda x, o: disp(x, o, 0))
    assert classes[:4] == [0, 0, 0, 0]
    assert all(c != 0 for c in classes[4:])


def test_probe_cli_on_bf16_fixture_one_class_per_op(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIVERGENCE_CACHE_DIR", str(tmp_path))
    assert main(["probe", "--rows", "1..24", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ops = {o["op"]: o for o in report["ops"]}
    assert {"q_proj", "k_proj", "down_proj", "lm_head", "sdpa"} <= set(ops)
    # SDPA at each default KV length, over query lengths up to it
    sdpa = [o for o in report["ops"] if o["op"] == "sdpa"]
    assert [o["shape"].rsplit("kv ", 1)[1] for o in sdpa] == ["64", "256", "1024"]
    assert all(o["rows"] == list(range(1, 25)) for o in sdpa)
    # MLX's own bf16 matmul on the CPU is batch-invariant: one class per linear op
    for name, o in ops.items():
        if name != "sdpa":
            assert set(o["classes"]) == {0}, (name, o["summary"])
    assert (tmp_path / "probe.json").exists()


@pytest.mark.blas
def test_probe_fp32_classes_are_what_a_direct_check_of_the_rows_finds(capsys, tmp_path, monkeypatch):
    """The probe's fp32 map of down_proj against an independent check, on whatever kernels
    this BLAS core picks: plain `x @ W.T` calls of M rows, each row's bits against the row
    computed alone. Class 0 exactly where they agree (Haswell kernels: M <= 9; SkylakeX /
    Cooperlake: depends on the whole shape; the reference BLAS: every M)."""
    import numpy as np

    from divergence.engine.kernels.blas import blas_in_use
    from divergence.engine.model.loading import load_model
    from divergence.fixtures import TARGET

    monkeypatch.setenv("DIVERGENCE_CACHE_DIR", str(tmp_path))
    rows = [1, 2, 4, 8, 16, 32, 64]
    assert main(["probe", "--dtype", "float32", "--rows", ",".join(map(str, rows)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    down = next(o for o in report["ops"] if o["op"] == "down_proj")
    w = load_model(TARGET, dtype="float32").model.model.layers[0].mlp.down_proj.weight
    x = mx.random.normal((64, w.shape[1]), key=mx.random.key(3))

    def bits(a):
        mx.eval(a)
        return np.array(a).view(np.uint32)

    alone = np.concatenate([bits(x[i: i + 1] @ w.T) for i in range(64)])
    direct = [all(np.array_equal(bits(x[j: j + m] @ w.T), alone[j: j + m]) for j in range(0, 64, m)) for m in rows]
    assert [c == 0 for c in down["classes"]] == direct, (blas_in_use(), down["summary"])
    if blas_in_use().startswith("reference"):
        assert all(direct)  # DESIGN.md: the bundled reference BLAS is batch-invariant


def test_sweep_counts_unique_completions(capsys):
    assert main(["sweep", "-n", "4", "--max-tokens", "24", "--max-batch", "4", "--policy", "batch-invariant",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["runs"] == 4 and r["unique_completions"] == 1 and r["counts"] == [4]

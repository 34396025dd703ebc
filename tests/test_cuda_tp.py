"""TP=2 on two GPUs over MLX's NCCL backend (issue 18).

Re-checks bench/results/cuda-tp2/ (made by its device.sh): the fixture at TP=1 and
at TP=2 (divergence's own launcher, DIVERGENCE_TP_BACKEND=nccl: one process per
GPU), bisect --bitwise --confirm of the pair, and probe --tp 2. Runs only where MLX's
CUDA wheel and two NVIDIA GPUs are present; elsewhere this module is one skip.
Collection imports nothing slow: the check reads package metadata and /dev.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "cuda-tp2"


def gpus() -> int:
    """NVIDIA device nodes, where MLX's CUDA wheel is installed (no mlx import)."""
    for dist in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            metadata.distribution(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        return 0
    return len(glob.glob("/dev/nvidia[0-9]*"))


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(gpus() < 2, reason="needs MLX's CUDA backend and two NVIDIA GPUs (TP=2 over NCCL)"),
]


def _cli(*args: str, ok=(0,), env_extra=None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "divergence", *args, "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode in ok, f"divergence {args[0]} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def _recorded(name: str):
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    common = ["--model", str(ROOT / "fixtures" / "target"), "--policy", "native", "--dtype", "bfloat16",
              "--prompts", str(RESULTS / "prompts.jsonl"), "--max-tokens", "64", "--ignore-eos"]
    _cli("run", *common, "--out", str(out / "tp1"))
    run2 = _cli("run", *common, "--tp", "2", "--out", str(out / "tp2"), env_extra={"DIVERGENCE_TP_BACKEND": "nccl"})
    return out, run2


def test_tp2_over_nccl_is_traced_and_tp1_vs_tp2_confirmed(pair):
    from divergence.trace.reader import Trace

    out, _ = pair
    with Trace.open(out / "tp2" / "serial.h5") as t:
        assert t.tp_degree == 2 and t.meta["settings"]["tp"]["backend"] == "nccl"
        assert set(t.allreduces()["op"]) == {"o_proj", "down_proj"}
    rep = _cli("bisect", str(out / "tp1" / "serial.h5"), str(out / "tp2" / "serial.h5"), "--bitwise", "--confirm",
               ok=(0, 1), env_extra={"DIVERGENCE_TP_BACKEND": "nccl"})
    assert rep["tp_degrees"] == [1, 2] and len(rep["requests"]) == 8
    diverged = [r for r in rep["requests"] if r["status"] == "diverged"]
    for r in diverged:
        assert r["root_cause"]["tensor_parallel"]["sharded_to_all"] == ["o_proj", "down_proj"], r
        assert r["confirmed"] is True, r["root_cause"]["confirm_detail"]
    recorded = _recorded("fixture_tp1_vs_tp2_bisect.json")
    if recorded is not None and _same_gpu():
        assert sorted(r["id"] for r in diverged) == sorted(r["id"] for r in recorded["requests"]
                                                            if r["status"] == "diverged")


def test_probe_tp2_over_nccl_matches_the_recorded_map():
    got = _cli("probe", "--tp", "2", "--rows", "1..64", env_extra={"DIVERGENCE_TP_BACKEND": "nccl"})
    by = {o["dtype"]: o for o in got["allreduce"]}
    assert set(by) == {"float32", "bfloat16"} and all(o["backend"] == "nccl" for o in by.values())
    recorded = _recorded("probe_tp2_fixture.json")
    if recorded is not None and _same_gpu():
        for o in recorded["allreduce"]:
            rows = o["rows"][:64]
            assert by[o["dtype"]]["classes"][:len(rows)] == o["classes"][:len(rows)], o["dtype"]


def _same_gpu() -> bool:
    """Recorded results are re-checked exactly only on the GPU model and MLX they came from."""
    recorded = _recorded("probe_tp2_fixture.json")
    if recorded is None:
        return False
    from divergence.engine.kernels.environment import environment

    now, then = environment(), recorded["environment"]
    return now.get("device_name") == then.get("device_name") and now.get("mlx") == then.get("mlx")

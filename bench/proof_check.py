"""Which gemv / batch-invariant proofs hold on this backend, by the old probe and the new.

    python bench/proof_check.py --model qwen0.5b      # on the GPU (the random 0.5B shape, bf16)
    python bench/proof_check.py --quick               # the fixture, CPU

For the linear ops of layer 0 and the head, at 1..16 rows: does `kernel` (gemv: each row
alone; batch-invariant: 8-row tiles) give the bits of one native m-row call, judged on
random normal rows alone (PROOF_METHOD 1) and on those plus rows that reveal another
summation order (order_probe, PROOF_METHOD 2)? A row where the old probe says "same" and
the new one does not is a proof the engine used to take that the backend does not keep.
Writes bench/results/proof_check.json (--quick: a temp dir).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

import numpy as np

os.environ["DIVERGENCE_PROOF_CACHE"] = "off"
from divergence.engine.kernels import backend_proofs as bp, linear as K  # noqa: E402
from divergence.engine.kernels.linear import LinearOp  # noqa: E402


def old_probe(op, kernel, m, dtype) -> bool:
    definition = {K.GEMV: K.gemv_rows, K.BATCH_INVARIANT: K.tiled}[kernel]
    x = mx.random.normal((m, op.k), key=mx.random.key(13)).astype(dtype)
    a, b = definition(x, op), op.native(x)
    return bool(np.array_equal(np.array(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32)),
                               np.array(b.view(mx.uint16 if b.dtype.size == 2 else mx.uint32))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="fixture | qwen0.5b | qwen0.5b-4bit (default: qwen0.5b; --quick: fixture)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: as stored)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="1-16")
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    meta = C.meta(a)
    target, _d, _w = C.fixture_paths()
    name = a.model or ("fixture" if a.quick else "qwen0.5b")
    t = C.load(C.model_path(name, target, a.model_cache), a.dtype)
    dtype = t.dtype if not isinstance(t.dtype, str) else getattr(mx, t.dtype)
    lo, hi = (int(v) for v in a.rows.split("-"))
    inner = t.model.model if hasattr(t.model, "model") else t.model
    layer = inner.layers[0]
    mods = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj, "o_proj": layer.self_attn.o_proj,
            "gate_proj": layer.mlp.gate_proj, "down_proj": layer.mlp.down_proj}
    head = getattr(t.model, "lm_head", None)
    ops = {n: LinearOp.from_module(n, m) for n, m in mods.items()}
    ops["lm_head"] = (LinearOp.from_module("lm_head", head) if head is not None
                      else LinearOp.from_module("lm_head", inner.embed_tokens, tied_embedding=True))
    rows, out = [], []
    for kernel in (K.GEMV, K.BATCH_INVARIANT):
        for n, op in ops.items():
            old, new = [], []
            for m in range(lo, hi + 1):
                if kernel == K.GEMV and m == 1:
                    continue
                bp.PROOFS = bp.BackendProofs()
                o = old_probe(op, kernel, m, dtype)
                w = bp.same_as_native(op, kernel, m, dtype)
                old.append(m) if o else None
                new.append(m) if w else None
                out.append({"kernel": kernel, "op": n, "m": m, "old_same": o, "new_same": w})
            taken = sorted(set(old) - set(new))
            rows.append([kernel, n, f"{op.n}x{op.k}", ",".join(map(str, old)) or "-",
                         ",".join(map(str, new)) or "-", ",".join(map(str, taken)) or "-"])
    print(C.table(rows, ["kernel", "op", "NxK", "old: same at m", "new: same at m", "old proof wrong at m"]), flush=True)
    path = C.out_path("proof_check", a.quick, a.out)
    C.write_json(Path(path), {"meta": meta, "model": name, "dtype": str(dtype), "results": out})
    print(f"[bench] -> {path}")


if __name__ == "__main__":
    main()

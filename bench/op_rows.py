"""Which op of a model's forward changes a row's bits when more rows share the call?

For every stage of each decoder layer (norms, q/k/v/o, gate/up, swiglu, down,
residual adds) and the head, run the backend's native op once on B rows and once
on each row alone, and compare every row bit for bit. Inputs are the model's
real hidden states (the batched forward of B short prompts' last tokens), so
scales are realistic. This is the experiment behind `probe`'s op list: on MLX's
CUDA backend it tells which ops besides the linear layers depend on the row
count (attention runs per sequence in the engine, so only its query length
matters; `probe` covers that).

    python bench/op_rows.py --model fixtures/target --rows 8 [--json out.json]
    python bench/op_rows.py --quick        # the embedded fixture, 4 rows
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.activations import swiglu  # noqa: E402

from divergence.engine.model.forward import PackedForward  # noqa: E402
from divergence.engine.model.loading import load_model  # noqa: E402


from divergence.engine.kernels.bits import raw_bits as _bits  # noqa: E402


def rows_differ(fn, x: mx.array) -> list[int]:
    """Rows whose bits differ between fn(x) and fn(x[i:i+1])."""
    full = fn(x)
    mx.eval(full)
    fb = _bits(full)
    bad = []
    for i in range(x.shape[0]):
        one = fn(x[i : i + 1])
        mx.eval(one)
        if not np.array_equal(fb[i : i + 1], _bits(one)):
            bad.append(i)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded fixture")
    ap.add_argument("--rows", type=int, default=None, help="default 8 (--quick: 4)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.model is None:
        from divergence.fixtures import TARGET

        args.model = str(TARGET)
    args.rows = args.rows or (4 if args.quick else 8)
    loaded = load_model(args.model)
    fwd = PackedForward(loaded)
    rng = np.random.default_rng(0)
    vocab = fwd.head.n
    tokens = mx.array(rng.integers(1, min(vocab, 1000), size=args.rows).astype(np.int32))
    h = fwd.inner.embed_tokens(tokens)
    result = {"model": str(args.model), "device": str(mx.default_device()), "mlx": mx.__version__,
              "dtype": str(fwd.dtype), "rows": args.rows, "layers": []}
    for li, (layer, ops) in enumerate(zip(fwd.blocks, fwd.ops)):
        stages = {}
        x = layer.input_layernorm(h)
        stages["input_layernorm"] = rows_differ(layer.input_layernorm, h)
        for op in (ops.q, ops.k, ops.v):
            stages[op.name] = rows_differ(op.native, x)
        # attention stand-in: values of this row only (per-sequence attention over 1 key)
        a = ops.v.native(x)
        rep = fwd.n_heads // fwd.n_kv_heads
        a = mx.repeat(a.reshape(a.shape[0], fwd.n_kv_heads, -1), rep, axis=1).reshape(a.shape[0], -1)
        stages["o_proj"] = rows_differ(ops.o.native, a)
        stages["residual_add"] = rows_differ(lambda t: t + 0.5 * t, h)
        h = h + ops.o.native(a)
        x = layer.post_attention_layernorm(h)
        stages["post_attention_layernorm"] = rows_differ(layer.post_attention_layernorm, h)
        g, u = ops.gate.native(x), ops.up.native(x)
        stages["gate_proj"] = rows_differ(ops.gate.native, x)
        stages["up_proj"] = rows_differ(ops.up.native, x)
        gu = mx.concatenate([g, u], axis=1)
        n = g.shape[1]
        stages["swiglu"] = rows_differ(lambda t: swiglu(t[:, :n], t[:, n:]), gu)
        s = swiglu(g, u)
        stages["down_proj"] = rows_differ(ops.down.native, s)
        h = h + ops.down.native(s)
        mx.eval(h)
        result["layers"].append({k: v for k, v in stages.items()})
        if li >= 3:
            break
    stages = {"final_norm": rows_differ(fwd.inner.norm, h)}
    stages["lm_head"] = rows_differ(fwd.head.native, fwd.inner.norm(h))
    result["head"] = stages
    for li, st in enumerate(result["layers"]):
        bad = {k: v for k, v in st.items() if v}
        print(f"layer {li}: " + (", ".join(f"{k} rows {v}" for k, v in bad.items()) or "every stage row-invariant"))
    bad = {k: v for k, v in result["head"].items() if v}
    print("head: " + (", ".join(f"{k} rows {v}" for k, v in bad.items()) or "row-invariant"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

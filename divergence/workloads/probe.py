"""Map a backend's batch-invariance: for each linear-op shape of a model and each
row count M, do calls of M rows compute the probe rows with the same bits as calls
of one row (engine.kernels.native_classes)?

Row counts with equal signatures fall into one class; the map reads as a table,
measured instead of guessed ("q_proj 896x896 bf16: rows 1..5 one class, 8..128
another"). SDPA is probed over query lengths, and the
`attention` kernels over batch sizes, per padding layout (right: the engine's
`batched`; left: mlx-lm BatchGenerator's) and query rows (decode, verify):
class 0 = the bits of each sequence alone (`per-seq`).
Results are cached per (backend, device, MLX version, shape, dtype).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..engine.kernels import blas as _blas  # noqa: F401  (loads the optimized BLAS: must precede mlx)
import mlx.core as mx

from ..core.atomic import write_atomic
from ..engine.model.forward import PackedForward
from ..engine.kernels.linear import LinearOp
from ..engine.kernels.bits import raw_bits as _bits
from ..core.classes import OpProbe, classify
from ..engine.engine import environment
from ..engine.kernels.backend_proofs import fingerprint
from ..engine.kernels.native_classes import LAYOUTS, AttentionClassProbe, NativeClassProbe
from ..errors import DivergenceInputError

CACHE_ENV = "DIVERGENCE_CACHE_DIR"
DEFAULT_KV_LENS = (64, 256, 1024)  # KV lengths SDPA is probed at
PROBE_METHOD = "rows32"  # part of the cache key: a change of method must not reuse old maps


def probe_linear(op: LinearOp, rows: list[int], dtype, *, run=None) -> list[int]:
    """Class per row count of `run(x, op)` (default: the native op): the same probe and
    signatures the engine records in traces (engine.kernels.native_classes)."""
    return NativeClassProbe(run).classes(op, rows, dtype)


def probe_sdpa(n_heads: int, n_kv: int, head_dim: int, dtype, rows: list[int], kv_len: int = 256) -> list[int]:
    """Class per query length L: the last query row of a causal L-query SDPA vs the same query alone."""
    key = mx.random.key(1)
    k = mx.random.normal((1, n_kv, kv_len, head_dim), key=key).astype(dtype)
    v = mx.random.normal((1, n_kv, kv_len, head_dim), key=mx.random.key(2)).astype(dtype)
    q = mx.random.normal((1, n_heads, max(rows), head_dim), key=mx.random.key(3)).astype(dtype)
    scale = head_dim ** -0.5
    outs = []
    for L in [1] + [r for r in rows if r != 1]:
        qs = q[:, :, max(rows) - L:]
        o = mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale, mask="causal" if L > 1 else None)
        outs.append(_bits(o[:, :, -1]))
    classes = classify(outs)
    return classes if rows[0] == 1 else classes[1:]


ATTENTION_QUERIES = (1, 4)  # query rows per sequence probed: decode, and a verify of spec_k = 3
ATTENTION_MAX_BATCH = 64


def probe_attention(heads: int, kv_heads: int, head_dim: int, dtype, batches: list[int], queries: int,
                    layout: str) -> list[int]:
    """Class per batch size B of a masked batched SDPA over B sequences padded on `layout`'s
    side (right: the engine's `batched`; left: mlx-lm BatchGenerator's; equal: B sequences of
    one length, unmasked, as both call it when nothing needs masking): 0 = every probe
    sequence's output has the bits of that sequence alone (`per-seq`)."""
    p = AttentionClassProbe()
    outs = [p.outputs("per-seq", 1, heads, kv_heads, head_dim, queries, dtype)]
    outs += [p.outputs("batched", b, heads, kv_heads, head_dim, queries, dtype, layout=layout) for b in batches]
    return classify(outs)[1:]


def cache_key(shape: str, dtype: str, quant, rows) -> str:
    # the backend's fingerprint (device, MLX, BLAS, its core and threads): a map made under
    # one OpenBLAS core is never reused under another
    raw = json.dumps([PROBE_METHOD, fingerprint(), shape, dtype, quant, list(rows)], sort_keys=True)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _cache_path() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "divergence")
    return Path(base) / "probe.json"


def probe_model(loaded, rows: list[int], *, use_cache: bool = True, kv_lens=DEFAULT_KV_LENS) -> dict:
    """The class map of every distinct linear-op shape of a model, plus SDPA (over query
    lengths, at each KV length: kernels pick tiles from both)."""
    fwd = PackedForward(loaded)
    dtype = fwd.dtype
    dname = str(dtype).replace("mlx.core.", "")
    quant = loaded.config.get("quantization")
    cache = {}
    cpath = _cache_path()
    if use_cache and cpath.exists():
        try:
            cache = json.loads(cpath.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    seen: dict[tuple, OpProbe] = {}
    ops = [(li, o) for li in range(fwd.num_layers) for o in fwd.layer_linear_ops(li)]
    ops.append((fwd.num_layers, fwd.head))
    for li, op in ops:
        key = (op.name, op.n, op.k)
        if key in seen:
            seen[key].layers.append(li)
            continue
        shape = f"{op.n}x{op.k}"
        ck = cache_key(f"{op.name}:{shape}", dname, quant, rows)
        classes = cache.get(ck) or probe_linear(op, rows, dtype)
        cache[ck] = classes
        seen[key] = OpProbe(op.name, shape, dname + (f" q{quant.get('bits')}" if quant else ""), list(rows),
                            classes, [li])
    sdpa = [OpProbe("sdpa", f"{fwd.n_heads}h/{fwd.n_kv_heads}kv x {fwd.head_dim}, kv {kv}", dname,
                    [r for r in rows if r <= kv],
                    probe_sdpa(fwd.n_heads, fwd.n_kv_heads, fwd.head_dim, dtype, [r for r in rows if r <= kv], kv))
            for kv in kv_lens if any(r <= kv for r in rows)]
    batches = [b for b in rows if b <= ATTENTION_MAX_BATCH]
    attn = []
    for q in ATTENTION_QUERIES:
        for layout in LAYOUTS:
            if layout == "equal" and q > 1:
                continue  # several query rows are always masked (causal)
            how = "equal lengths, unmasked" if layout == "equal" else f"{layout}-padded"
            shape = f"{fwd.n_heads}h/{fwd.n_kv_heads}kv x {fwd.head_dim}, q{q}, {how}"
            ck = cache_key(f"attention:{shape}", dname, quant, batches)
            classes = cache.get(ck) or probe_attention(fwd.n_heads, fwd.n_kv_heads, fwd.head_dim, dtype, batches,
                                                       q, layout)
            cache[ck] = classes
            attn.append(OpProbe("attention", shape, dname, batches, classes, unit="batch", base="per-seq"))
    if use_cache:
        try:
            cpath.parent.mkdir(parents=True, exist_ok=True)

            write_atomic(cpath, json.dumps(cache))  # a full disk keeps the old cache, not half of a new one
        except OSError:
            pass

    return {"model": str(loaded.path), "environment": environment(),
            "ops": [p.to_json() for p in seen.values()] + [p.to_json() for p in sdpa] + [p.to_json() for p in attn]}


def parse_rows(text: str, what: str = "--rows") -> list[int]:
    """'1..128' -> every row count from 1 to 128; '1,2,4,8' -> those."""
    try:
        if ".." in text:
            a, b = text.split("..", 1)
            rows = list(range(int(a), int(b) + 1))
        else:
            rows = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise DivergenceInputError(f"bad {what} {text!r}: expected A..B or a comma list") from None
    if not rows or rows[0] < 1 or rows[-1] > 65536:
        raise DivergenceInputError(f"bad {what} {text!r}: values must be within 1..65536")
    return rows

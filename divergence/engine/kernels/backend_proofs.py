"""Facts of the backend in use, proved by a probe once and cached by its fingerprint.

Which shortcut is bit-safe depends on the kernels the backend picks, and those depend on
the device, the BLAS library, its core (OpenBLAS picks one per CPU, or OPENBLAS_CORETYPE)
and its thread count. A proof is keyed by all of them, so a proof made under one core is
never reused under another; it is kept in the user cache dir (DIVERGENCE_CACHE_DIR, else
~/.cache/divergence) so that a run does not pay for the probe again.
The native kernels' class signatures (native_classes.py) are kept the same way, in a file
of their own. DIVERGENCE_PROOF_CACHE=off keeps both in memory only (each process probes again).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import mlx.core as mx

CACHE_ENV = "DIVERGENCE_CACHE_DIR"
OFF_ENV = "DIVERGENCE_PROOF_CACHE"
PROOF_METHOD = 2  # part of the fingerprint: a change of how things are proved must not reuse old proofs
# (2: probe rows that reveal another summation order, order_probe.py, beside the random ones)
REVEALING_SEEDS = (0, 1, 2)  # order_probe rows per proof, each aimed at other output columns


def fingerprint() -> dict:
    """What decides the bits of a kernel here, beside the shapes and dtype a proof names."""
    from .environment import environment

    env = environment()
    keys = ("backend", "device", "device_name", "mlx", "blas", "blas_core", "blas_config", "blas_threads")
    return {"method": PROOF_METHOD, **{k: env.get(k) for k in keys}}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "divergence")


def cache_off() -> bool:
    """DIVERGENCE_PROOF_CACHE=off (or 0 / no / none): measured values stay in memory."""
    return os.environ.get(OFF_ENV, "").strip().lower() in ("off", "0", "no", "none")


class BackendStore:
    """Values measured on the backend in use, kept per backend fingerprint in the user cache
    dir: `<prefix>-<fingerprint digest>.json`, {"fingerprint": ..., "<prefix>": {key: value}}.
    get / put; with DIVERGENCE_PROOF_CACHE=off, in memory only.

    put does not rewrite the file each time (a fresh server puts a key per new shape, and the
    file holds thousands): the first put writes at once, later ones mark the store dirty and
    one write, FLUSH_AFTER_S after the last, takes them all (a timer thread), as does
    flush(), process exit, and a store of this process about to read the same file. A write
    merges what the file holds by then (another process's keys) under this store's values,
    and goes to a temporary name renamed over the file: concurrent writers can lose each
    other's newest keys (measured again later), never corrupt the file. A read-only home or
    a full disk leaves the values in memory."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._memo: dict[str, object] = {}
        self._fingerprint: dict | None = None  # the process's backend: read once
        self._path: Path | None = None
        self._loaded = False
        self._lock = threading.RLock()  # put (any thread) against the timer's write
        self._dirty = False
        self._timer: threading.Timer | None = None
        self._written_at = -math.inf  # time.monotonic() of the last write
        self.writes = 0  # files written (tests)
        _STORES.add(self)

    def _file(self) -> Path | None:
        if cache_off():
            return None
        if self._path is None:
            self._fingerprint = fingerprint()
            fp = json.dumps(self._fingerprint, sort_keys=True)
            self._path = cache_dir() / f"{self.prefix}-{hashlib.sha256(fp.encode()).hexdigest()[:16]}.json"
        return self._path

    def _read(self, path: Path) -> dict:
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: measure again
        if isinstance(stored, dict) and isinstance(stored.get(self.prefix), dict):
            return {str(k): v for k, v in stored[self.prefix].items()}
        return {}

    def _load(self) -> None:
        self._loaded = True
        path = self._file()
        if path is None:
            return
        for other in list(_STORES):  # what this process has measured but not written yet
            if other is not self and other._dirty and other._path == path:
                other.flush()
        with self._lock:
            for k, v in self._read(path).items():
                self._memo.setdefault(k, v)

    def get(self, key: str):
        if not self._loaded:
            self._load()
        return self._memo.get(key)

    def put(self, key: str, value) -> None:
        if not self._loaded:
            self._load()
        with self._lock:
            self._memo[key] = value
            if self._file() is None:
                return
            self._dirty = True
            if self._timer is not None:
                return  # the pending write takes this one too
            wait = self._written_at + FLUSH_AFTER_S - time.monotonic()
            if wait > 0:
                self._timer = threading.Timer(wait, self._timed_flush)
                self._timer.daemon = True
                self._timer.start()
                return
        self.flush()

    def _timed_flush(self) -> None:
        with self._lock:
            self._timer = None
        self.flush()

    def flush(self) -> None:
        """Write what is not written yet (merged with the file as it is now), if anything."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            path = self._file()
            if not self._dirty or path is None:
                return
            self._dirty = False
            self._written_at = time.monotonic()
            from ...core.atomic import write_atomic

            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                merged = {**self._read(path), **self._memo}
                write_atomic(path, json.dumps({"fingerprint": self._fingerprint, self.prefix: merged},
                                              sort_keys=True))
                self.writes += 1
                for k, v in merged.items():
                    self._memo.setdefault(k, v)
            except OSError:  # a read-only home or a full disk: the values stay in memory
                pass


FLUSH_AFTER_S = 2.0  # a put's write waits this long after the last write (puts meanwhile share it)
_STORES: "weakref.WeakSet[BackendStore]" = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    for store in list(_STORES):
        store.flush()


def _after_fork() -> None:  # a child has none of the parent's timer threads: its puts start new ones
    for store in list(_STORES):
        store._lock = threading.RLock()
        store._timer = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class BackendProofs(BackendStore):
    """proved(key, probe): probe() -> bool, run once per key and backend fingerprint."""

    def __init__(self):
        super().__init__("proofs")

    def proved(self, key: str, probe: Callable[[], bool]) -> bool:
        got = self.get(key)
        if got is None:
            got = bool(probe())
            self.put(key, got)
        return bool(got)


PROOFS = BackendProofs()  # one per process: the backend is the process's


def row_alone_is_exact(op, m: int, row: int, dtype) -> bool:
    """Does row `row` of an m-row call of `op` have the bits of that row computed alone?
    The engine computes a prefill's logits for its last row only where this holds; where it
    does not (small-matrix kernels, GEMV vs GEMM) it computes every row, as mlx-lm does."""
    if m <= 1:
        return True
    key = f"row-alone:{op.name}:{op.n}x{op.k}:{op.precision}:{dtype}:{m}:{row}"

    def probe() -> bool:
        def same(x):
            whole = op.native(x)[row]
            alone = op.native(x[row: row + 1])[0]
            return whole, alone

        return _equal_on_probe_rows(op, m, dtype, 11, same)

    return PROOFS.proved(key, probe)


def same_as_native(op, kernel: str, m: int, dtype) -> bool:
    """Does `kernel` ("gemv": each row its own M=1 call; "batch-invariant": rows padded to
    INVARIANT_TILE-row calls) give, at m rows of `dtype`, the bits of one native m-row call?
    Where it does (MLX's bf16 / fp16 CPU matmul: one fixed-order sum per output, whatever M;
    an fp32 BLAS only at the row counts its kernels agree), the kernel runs as that one call:
    the same bits, without m weight passes or the padding rows. Probed with the op's own
    weights on random rows and on rows that reveal another summation order, as
    row_alone_is_exact is."""
    from . import linear

    definition = {linear.GEMV: linear.gemv_rows, linear.BATCH_INVARIANT: linear.tiled}[kernel]
    rows = 1 if kernel == linear.GEMV else linear.INVARIANT_TILE  # the definition's calls
    if kernel == linear.BATCH_INVARIANT:
        kernel = f"{kernel}{linear.INVARIANT_TILE}"
    # the CPU column split either call takes is part of what was compared (a process's split
    # is fixed, but tests and benches configure another): a proof made unsplit says nothing
    # of a split product's bits (OpenBLAS Haswell: 2 parts at m = 7 differ from 7 rows alone)
    parts = "-".join(str(linear.split_parts(r, op, dtype)) for r in (m, rows))
    key = f"same-as-native:{kernel}:{op.name}:{op.n}x{op.k}:{op.precision}:{dtype}:{m}:parts{parts}"

    def probe() -> bool:
        return _equal_on_probe_rows(op, m, dtype, 13, lambda x: (definition(x, op), op.native(x)))

    return PROOFS.proved(key, probe)


def _equal_on_probe_rows(op, m: int, dtype, key: int, pair: Callable) -> bool:
    """Do the two arrays `pair(x)` computes have the same bits for every probe x: random normal
    rows, and rows that reveal another summation order (order_probe: random rows rounded to a
    bf16 output hide most reorderings of an fp32 sum, so a probe of them alone proves little)."""
    from .bits import raw_bits
    from .order_probe import revealing_rows

    def probes():  # made one at a time: the first that differs ends the proof
        yield mx.random.normal((m, op.k), key=mx.random.key(key)).astype(dtype)
        for seed in REVEALING_SEEDS:
            yield revealing_rows(op, m, dtype, seed)

    for x in probes():
        a, b = pair(x)
        mx.eval(a, b)
        if not (raw_bits(a) == raw_bits(b)).all():
            return False
    return True

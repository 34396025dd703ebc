"""A Python engine written here in plain numpy records through divergence.record: its
batched run diverges from serial, bisect names the batch step, and `--confirm-cmd`
re-running this file with that step split confirms it.

The engine: two layers of single-head attention, float32 with bf16 activations and
its own KV cache (a dict of per-request arrays), and a matmul whose kernel depends
on the row count: one row runs `gemv` (k in order), more run `gemm/2` (two partial
sums over K, each rounded to bf16, then added). This file is also the engine's
command line (`python test_numpy_engine.py --schedule batched --out T.h5`).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np

VOCAB, DIM, LAYERS, TOP_K = 40, 24, 2, 5
PROMPTS = {"r1": [4, 8, 15, 16, 23, 9, 2], "r2": [1, 30, 12, 7, 7]}
MAX_TOKENS = {"r1": 36, "r2": 1}
ARRIVAL = {"r1": 0, "r2": 4}  # r2's prefill joins r1's decode in step 4


def bf16(x):
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def ordered_sum(x, axis):
    """A reduction in a fixed order, elementwise ops only: the same bits on any CPU."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, 0)
    acc = x[0].copy()
    for i in range(1, x.shape[0]):
        acc += x[i]
    return acc


def matmul(x, w, kernel):
    if kernel == "gemv":
        return ordered_sum(x[:, :, None] * w[None], 1)
    half = w.shape[0] // 2
    return bf16(matmul(x[:, :half], w[:half], "gemv")) + bf16(matmul(x[:, half:], w[half:], "gemv"))


class NumpyEngine:
    def __init__(self, recorder, *, split_step=None, seed=3):
        rng = np.random.default_rng(seed)
        self.w = {"embed": rng.standard_normal((VOCAB, DIM)).astype(np.float32),
                  "pos": rng.standard_normal((256, DIM)).astype(np.float32),
                  "head": (rng.standard_normal((DIM, VOCAB)) * 0.5).astype(np.float32)}
        for layer in range(LAYERS):
            for n in "qkvo":
                self.w[f"{layer}{n}"] = (rng.standard_normal((DIM, DIM)) / math.sqrt(DIM)).astype(np.float32)
        self.rec = recorder
        self.split_step = split_step
        self.kv: dict[str, list[list[np.ndarray]]] = {}  # request -> layer -> [K, V] float32 [pos, DIM]
        self.step = 0

    def forward(self, batch):
        """batch: [(request, phase, start, tokens)] -> {request: logits of its last row}."""
        rows = sum(len(t) for *_, t in batch)
        kernel = "gemv" if rows == 1 else "gemm/2"
        self.rec.step([(rid, phase, start, len(toks)) for rid, phase, start, toks in batch], index=self.step)
        pos = np.concatenate([np.arange(s, s + len(t)) for _, _, s, t in batch])
        h = bf16(self.w["embed"][np.concatenate([t for *_, t in batch])] + self.w["pos"][pos])
        for layer in range(LAYERS):
            def mm(x, n, op):
                self.rec.kernel(op, kernel, layer=layer, rows=rows, n=DIM, k=DIM)
                return bf16(matmul(x, self.w[f"{layer}{n}"], kernel))

            x = bf16(h / np.sqrt(ordered_sum(h * h, 1)[:, None] / DIM + 1e-5))
            q, k, v = mm(x, "q", "wq"), mm(x, "k", "wk"), mm(x, "v", "wv")
            out, row = [], 0
            for rid, _, start, toks in batch:
                n = len(toks)
                cache = self.kv.setdefault(rid, [[np.zeros((0, DIM), np.float32)] * 2 for _ in range(LAYERS)])
                kc = cache[layer][0] = np.concatenate([cache[layer][0][:start], k[row:row + n]])
                vc = cache[layer][1] = np.concatenate([cache[layer][1][:start], v[row:row + n]])
                from divergence.record import hash_kv

                self.rec.kv_write(rid, layer=layer, start=start, k_hashes=hash_kv(kc[start:]),
                                  v_hashes=hash_kv(vc[start:]))
                s = ordered_sum(q[row:row + n, None] * kc[None], 2) / np.float32(math.sqrt(DIM))
                s[np.arange(kc.shape[0])[None] > (start + np.arange(n))[:, None]] = -np.inf
                p = np.array([math.exp(z) for z in (s - s.max(1, keepdims=True)).ravel()], np.float32).reshape(s.shape)
                p /= ordered_sum(p, 1)[:, None]
                out.append(bf16(ordered_sum(p[:, :, None] * vc[None], 1)))
                row += n
            h = bf16(h + mm(np.concatenate(out), "o", "wo"))
        last = np.cumsum([len(t) for *_, t in batch]) - 1
        self.rec.kernel("head", "gemv" if len(last) == 1 else "gemm/2", layer=LAYERS, rows=len(last))
        logits = matmul(h[last], self.w["head"], "gemv" if len(last) == 1 else "gemm/2")
        self.step += 1
        return {rid: logits[i] for i, (rid, *_) in enumerate(batch)}

    def run(self, schedule):
        seqs = {rid: list(p) for rid, p in PROMPTS.items()}
        waiting, running, loop = list(PROMPTS), [], 0
        while waiting or running:
            if schedule == "serial":
                new = [waiting.pop(0)] if not running else []
            else:
                new = [r for r in waiting if ARRIVAL[r] <= loop]
                waiting = [r for r in waiting if r not in new]
            running += new
            batch = [(r, "prefill", 0, seqs[r]) if r in new else (r, "decode", len(seqs[r]) - 1, seqs[r][-1:])
                     for r in running]
            groups = [[b] for b in batch] if self.step == self.split_step else [batch]
            for group in groups:
                step = self.step
                for rid, lg in self.forward(group).items():
                    ids = sorted(range(VOCAB), key=lambda i: (-lg[i], i))[:TOP_K]
                    seqs[rid].append(ids[0])
                    self.rec.token(rid, position=len(seqs[rid]) - 1, token=ids[0], topk_ids=ids,
                                   topk_logits=lg[ids], step=step)
                    if len(seqs[rid]) - len(PROMPTS[rid]) == MAX_TOKENS[rid]:
                        self.rec.finish(rid, reason="length", step=step)
                        running.remove(rid)
            loop += 1


def record(schedule, out, *, split_step=None):
    from divergence.record import Recorder

    requests = [{"id": r, "prompt": p, "max_tokens": MAX_TOKENS[r], "arrival": ARRIVAL[r]} for r, p in PROMPTS.items()]
    with Recorder(out, engine="numpy-test-engine", schedule=schedule, requests=requests, top_k=TOP_K,
                  model={"name": "two-layer", "weights_hash": "seed3", "dtype": "bfloat16"},
                  settings={"split_step": split_step}) as rec:
        NumpyEngine(rec, split_step=split_step).run(schedule)
    return out


# -- the tests ------------------------------------------------------------------------------
def _bisect(tmp_path, capsys, *extra):
    from divergence.cli.main import main

    a, b = record("serial", tmp_path / "serial.h5"), record("batched", tmp_path / "batched.h5")
    capsys.readouterr()
    rc = main(["bisect", str(a), str(b), "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_serial_and_batched_diverge_and_bisect_names_the_batch_step(tmp_path, capsys):
    rc, rep = _bisect(tmp_path, capsys)
    assert rc == 1
    r1 = next(r for r in rep["requests"] if r["id"] == "r1")
    assert r1["status"] == "diverged"
    c = r1["root_cause"]
    assert (c["kind"], c["step_b"], c["kernel_a"], c["kernel_b"], c["co_batched_b"], c["op"]) == \
           ("cache_contamination", 4, "gemv", "gemm/2", ["r2"], "wq")
    assert c["rows_b"] == 1 + len(PROMPTS["r2"]) and c["rows_a"] == 1
    assert r1["first_divergent_token"]["step_b"] > 4 + MAX_TOKENS["r2"]  # r2 long gone when the text flips


def test_confirm_cmd_reruns_this_engine_with_the_step_split(tmp_path, capsys):
    me = f"{shlex.quote(sys.executable)} {shlex.quote(__file__)} --schedule batched"
    rc, rep = _bisect(tmp_path, capsys, "--confirm-cmd", f"{me} --split-step {{step}} --out {{out}}")
    r1 = next(r for r in rep["requests"] if r["id"] == "r1")
    assert r1["confirmed"] is True, r1["root_cause"]["confirm_detail"]
    assert "bit for bit" in r1["root_cause"]["confirm_detail"]
    rc, rep = _bisect(tmp_path, capsys, "--confirm-cmd", f"{me} --split-step 0 --out {{out}}")
    r1 = next(r for r in rep["requests"] if r["id"] == "r1")
    assert r1["confirmed"] is False, r1["root_cause"]["confirm_detail"]


def test_the_reference_kernel_is_exact_and_the_batched_one_is_not():
    """gemv against float64 numpy: the float32 ordered sum is within float32 rounding;
    gemm/2's bf16 partials are not: the engine's divergence is real, not planted bits."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, DIM)).astype(np.float32), rng.standard_normal((DIM, DIM)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(matmul(x, w, "gemv") - ref).max() < 1e-4
    assert np.abs(matmul(x, w, "gemm/2") - ref).max() > 1e-3
    assert np.array_equal(matmul(x, w, "gemv")[1:2], matmul(x[1:2], w, "gemv"))  # rows are independent


if __name__ == "__main__":  # the engine's command line, for --confirm-cmd
    sys.path.insert(0, str(Path(__file__).parents[2]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--split-step", type=int)
    args = ap.parse_args()
    record(args.schedule, Path(args.out), split_step=args.split_step)

#!/usr/bin/env python3
"""A tiny inference engine that is not divergence's: plain numpy, and it writes the
recording contract's JSON Lines (docs/recording.md) with nothing but `json`.

It stands for your engine. Two layers, bf16 activations and KV cache, continuous
batching, and a matmul whose kernel depends on the row count, as Candle's does
(seed 000): up to 4 rows run `mv` (one reduction order), more run `mm/4` (split-K
in 4 partitions: another order, other rounding). Run it twice and let divergence
find the batch step that contaminated the cache:

    python examples/toy_engine.py --schedule serial --out runs/serial
    python examples/toy_engine.py --schedule concurrent --out runs/concurrent
    divergence import runs/serial --out serial.h5
    divergence import runs/concurrent --out concurrent.h5
    divergence bisect serial.h5 concurrent.h5 --confirm-cmd \\
      'python examples/toy_engine.py --schedule concurrent --split-step {step} --out {out}'

`--split-step N` runs step N's sequences one forward pass each (the fix the
confirmation tries); `--force-kernel N=LABEL` runs step N on one kernel.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import numpy as np

ENGINE = "toy-engine 0.1 (examples/toy_engine.py)"
VOCAB, DIM, HEADS, LAYERS, TOP_K = 48, 32, 2, 2, 4
HEAD_DIM = DIM // HEADS
MV_MAX_ROWS = 4  # rows <= 4: mv; more: mm/4
REQUESTS = [  # r2 arrives while r1 decodes: its prefill and r1's decode share step 3 (7 rows: mm/4)
    {"id": "r1", "prompt": [5, 17, 3, 22, 9, 40, 11, 2], "max_tokens": 40, "arrival": 0},
    {"id": "r2", "prompt": [7, 7, 31, 14, 25, 1], "max_tokens": 3, "arrival": 3},
]


def weights(seed: int = 10) -> dict:
    rng = np.random.default_rng(seed)
    w = {"embed": rng.standard_normal((VOCAB, DIM)).astype(np.float32),
         "pos": rng.standard_normal((512, DIM)).astype(np.float32),
         "head": (rng.standard_normal((DIM, VOCAB)) * 0.3).astype(np.float32)}
    for layer in range(LAYERS):
        for name in ("q", "k", "v", "o", "up", "down"):
            shape = (DIM, 2 * DIM) if name == "up" else (2 * DIM, DIM) if name == "down" else (DIM, DIM)
            w[f"{layer}.{name}"] = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    return w


def matmul(x: np.ndarray, w: np.ndarray, label: str) -> np.ndarray:
    """x [T, K] @ w [K, N] with float32 accumulation in the kernel's own order."""
    x = x.astype(np.float32)
    if label == "mv":  # k = 0, 1, 2, ... in order
        acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
        for k in range(w.shape[0]):
            acc += x[:, k:k + 1] * w[k]
        return acc
    # mm/4: four partial sums over K, each stored in bf16 (the output dtype), then added
    parts = np.array_split(np.arange(w.shape[0]), 4)
    return sum((bf16(matmul(x[:, p], w[p], "mv")) for p in parts),
               np.zeros((x.shape[0], w.shape[1]), np.float32))


class Engine:
    def __init__(self, *, force: dict | None = None):
        self.w = weights()
        self.force = force or {}
        self.cache: dict[str, list] = {}  # request -> per layer [K bf16 [pos, heads, hd], V ...]
        self.out: dict[str, list] = {}  # kind -> records
        self.step_index = 0

    def emit(self, kind: str, **rec) -> None:
        self.out.setdefault(kind, []).append(rec)

    def forward(self, slices: list[tuple[str, str, int, list[int]]]) -> dict[str, np.ndarray]:
        """One packed forward pass over slices (request, phase, start, tokens); returns the
        logits of each slice's last row, and records the step."""
        step = self.step_index
        self.step_index += 1
        rows = sum(len(t) for _, _, _, t in slices)
        label = self.force.get(step, "mv" if rows <= MV_MAX_ROWS else "mm/4")
        self.emit("step", index=step, slices=[{"request": r, "phase": ph, "start": s, "count": len(t)}
                                              for r, ph, s, t in slices])
        positions = np.concatenate([np.arange(s, s + len(t)) for _, _, s, t in slices])
        h = bf16(self.w["embed"][np.concatenate([t for *_, t in slices])] + self.w["pos"][positions])
        for layer in range(LAYERS):
            def mm(x, name, op):
                self.emit("kernel", step=step, layer=layer, op=op, rows=rows, kernel=label,
                          n=int(self.w[f"{layer}.{name}"].shape[1]), k=int(self.w[f"{layer}.{name}"].shape[0]))
                return bf16(matmul(x, self.w[f"{layer}.{name}"], label))

            x = rms(h)
            q, k, v = mm(x, "q", "attn.q"), mm(x, "k", "attn.k"), mm(x, "v", "attn.v")
            att, row = [], 0
            for rid, _, start, toks in slices:
                n = len(toks)
                kc, vc = self.cache.setdefault(rid, [[np.zeros((0, HEADS, HEAD_DIM), np.float32)] * 2
                                                     for _ in range(LAYERS)])[layer]
                kn, vn = (a[row:row + n].reshape(n, HEADS, HEAD_DIM) for a in (k, v))
                kc, vc = np.concatenate([kc[:start], kn]), np.concatenate([vc[:start], vn])
                self.cache[rid][layer] = [kc, vc]
                self.emit("kv_write", step=step, request=rid, layer=layer, start=start,
                          k_hashes=[hash64(kc[p]) for p in range(start, start + n)],
                          v_hashes=[hash64(vc[p]) for p in range(start, start + n)])
                att.append(attention(q[row:row + n], kc, vc, start))
                row += n
            h = bf16(h + mm(np.concatenate(att), "o", "attn.o"))
            up = np.maximum(mm(rms(h), "up", "mlp.up"), 0)
            h = bf16(h + mm(up, "down", "mlp.down"))
        last = np.cumsum([len(t) for *_, t in slices]) - 1
        head_label = self.force.get(step, "mv" if len(last) <= MV_MAX_ROWS else "mm/4")
        self.emit("kernel", step=step, layer=LAYERS, op="lm_head", rows=len(last), kernel=head_label,
                  n=VOCAB, k=DIM)
        logits = matmul(rms(h[last]), self.w["head"], head_label)
        return {rid: logits[i] for i, (rid, *_) in enumerate(slices)}


def bf16(x) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), kept in float32 arrays: numpy has no bf16."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.view(np.float32)


# Every reduction runs in a fixed order with elementwise ops only (numpy's own sums and
# exp pick SIMD paths by CPU): the same run gives the same bits on any machine.
def seqsum(x: np.ndarray, axis: int) -> np.ndarray:
    x = np.moveaxis(np.asarray(x, np.float32), axis, 0)
    acc = x[0].copy()
    for i in range(1, x.shape[0]):
        acc += x[i]
    return acc


def exp(x: np.ndarray) -> np.ndarray:
    return np.array([math.exp(v) for v in x.ravel().tolist()], np.float64).astype(np.float32).reshape(x.shape)


def rms(x):
    ms = seqsum(x * x, -1)[..., None] / np.float32(x.shape[-1])
    return bf16(x / np.sqrt(ms + np.float32(1e-5)))


def attention(q, kc, vc, start):
    """Causal attention of one sequence's rows (q [n, dim]) over its cache [0, start + n)."""
    n = q.shape[0]
    qh = q.reshape(n, HEADS, HEAD_DIM)
    scores = seqsum(qh[:, None] * kc[None], -1) / np.float32(np.sqrt(HEAD_DIM))  # [n, pos, heads]
    mask = np.arange(kc.shape[0])[None, :] > (start + np.arange(n))[:, None]
    scores[mask] = -np.inf
    p = exp(scores - scores.max(1, keepdims=True))
    p = p / seqsum(p, 1)[:, None]
    return bf16(seqsum(p[..., None] * vc[None], 1).reshape(n, DIM))


def hash64(a: np.ndarray) -> str:
    """The contract's 64-bit hash of one position's exact bytes as the cache stores them
    (bf16: the top 2 bytes of each float32); this engine's hash is blake2b-64."""
    raw = (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
    return hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()


def run(schedule: str, *, split: int | None = None, split_requests=None, force=None) -> Engine:
    eng = Engine(force=force)
    state = {r["id"]: {"seq": list(r["prompt"]), "done": 0} for r in REQUESTS}
    waiting = list(REQUESTS)
    running: list[dict] = []
    loop = 0
    while waiting or running:
        if schedule == "serial":
            if not running:
                running.append(waiting.pop(0))
                new = running[-1:]
            else:
                new = []
        else:
            new = [r for r in waiting if r["arrival"] <= loop]
            waiting = [r for r in waiting if r not in new]
            running += new
        slices = []
        for r in running:
            st = state[r["id"]]
            if r in new:
                slices.append((r["id"], "prefill", 0, st["seq"]))
            else:
                slices.append((r["id"], "decode", len(st["seq"]) - 1, st["seq"][-1:]))
        if not slices:
            loop += 1
            continue
        if split is not None and eng.step_index == split and len(slices) > 1:
            alone = [s for s in slices if split_requests is None or s[0] in split_requests]
            rest = [s for s in slices if s not in alone]
            groups = [[s] for s in alone] + ([rest] if rest else [])
        else:
            groups = [slices]
        for group in groups:
            step = eng.step_index
            logits = eng.forward(group)
            for rid, _, start, toks in group:
                lg = logits[rid]
                order = sorted(range(VOCAB), key=lambda i: (-lg[i], i))[:TOP_K]  # ties: lower id
                token = order[0]
                st = state[rid]
                st["seq"].append(token)
                st["done"] += 1
                eng.emit("token", step=step, request=rid, position=len(st["seq"]) - 1, token=token,
                         topk_ids=order, topk_logits=[float(lg[i]) for i in order], logit=float(lg[token]))
                r = next(x for x in REQUESTS if x["id"] == rid)
                if st["done"] >= r["max_tokens"]:
                    eng.emit("finish", step=step, request=rid, reason="length")
                    running = [x for x in running if x["id"] != rid]
        loop += 1
    return eng


def write(eng: Engine, out: Path, schedule: str, *, one_file: bool = False) -> None:
    digest = hashlib.blake2b(b"".join(v.tobytes() for v in eng.w.values()), digest_size=16).hexdigest()
    run_rec = {"engine": ENGINE, "schedule": schedule, "kv_hash": "blake2b_64", "top_k": TOP_K,
               "policy": f"mv up to {MV_MAX_ROWS} rows, else mm/4",
               "model": {"name": "toy-2layer", "weights_hash": digest, "dtype": "bfloat16"},
               "vocab": [f"<{i}>" for i in range(VOCAB)]}
    kinds = {"run": [run_rec], "request": REQUESTS, **eng.out}
    out.mkdir(parents=True, exist_ok=True)
    files = {"run": "run", "request": "requests", "step": "steps", "kernel": "kernels", "kv_write": "kv_writes",
             "token": "tokens", "finish": "finishes"}
    # each file ends with its end record (the number of records before it): a file cut
    # short, even at a line boundary, is refused by the import instead of read as a shorter run
    if one_file:
        with open(out / "records.jsonl", "w") as f:
            for kind, recs in kinds.items():
                for r in recs:
                    f.write(json.dumps({"kind": kind, **r}) + "\n")
            f.write(json.dumps({"kind": "end", "records": sum(len(recs) for recs in kinds.values())}) + "\n")
        return
    for kind, recs in kinds.items():
        with open(out / f"{files[kind]}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
            f.write(json.dumps({"kind": "end", "records": len(recs)}) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=("serial", "concurrent"), required=True)
    p.add_argument("--out", required=True, help="directory for the JSON Lines files")
    p.add_argument("--split-step", type=int, help="run this step's sequences one forward pass each")
    p.add_argument("--split-requests", help="only these (comma-separated) go alone; the rest stay together")
    p.add_argument("--force-kernel", action="append", default=[], metavar="STEP=LABEL",
                   help="run every matmul of STEP on LABEL (mv or mm/4)")
    p.add_argument("--one-file", action="store_true", help="one records.jsonl with a 'kind' field per line")
    a = p.parse_args(argv)
    force = {int(s): lab for s, _, lab in (x.partition("=") for x in a.force_kernel)}
    split_requests = set(a.split_requests.split(",")) if a.split_requests else None
    eng = run(a.schedule, split=a.split_step, split_requests=split_requests, force=force)
    write(eng, Path(a.out), a.schedule, one_file=a.one_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

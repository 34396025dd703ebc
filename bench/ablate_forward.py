"""What the per-sequence attention loop costs at B>1, and what batching it would buy.

Historical: these prototypes measured the engine's forward before it was rebuilt
(commit c184080). The engine now does what they tried, for real: one RoPE call and
one scatter per layer, a head-major pool read by block, and batched decode attention
(kernel `batched`). The prototypes assume the old [slots, kv_heads, head_dim] pool and
the old forward, so they no longer run against today's engine; the results in
bench/results/ablate_forward*.json are the record of that measurement.

    python bench/ablate_forward.py --models fixture,qwen0.5b --dtypes float32

The engine's packed forward runs, per layer and per sequence: 3 slices, 2
RoPE calls, 2 scatters into the KV pool, 2 gathers from it, SDPA and a few
transposes, i.e. ~20 small MLX ops x B x layers per step. This script swaps
`PackedForward.__call__` (from the outside, for the duration of a run; the
engine's files are not edited) for prototypes of the fixes and measures
the decode step time (step timestamps after the prefill) and whether the
greedy tokens still equal the original's:

* `original`  the engine as it is.
* `grouped`   one scatter (K and V) and one gather per layer for all slices;
              RoPE and SDPA still per sequence.
* `batched`   steps whose slices are all single-row decodes: one RoPE call
              with a vector of offsets, one scatter, one padded gather and one
              SDPA call with a padding mask for the whole batch (mlx-lm's
              BatchKVCache does the same); other steps run the original code.
* `batched+greedy`  `batched`, plus greedy_rows as one batched argmax instead
              of one graph per row.
* `block-read` the original per-sequence forward, but K/V read by block
              (pool viewed as [blocks, 16, kv, hd], one gather index per block)
              instead of one gather index per position; matters at long context
              (`--prompt 1536`).
* `head-major` the original per-sequence forward with the KV pool stored
              [kv_heads, slots, head_dim] instead of [slots, kv_heads, head_dim],
              so SDPA gets contiguous per-head K/V instead of transposed views.

Writes bench/results/ablate_forward.json.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import common as C  # noqa: I001
from common import mx

import numpy as np
from mlx_lm.models.activations import swiglu

import divergence.engine.model.forward as F
import divergence.engine.sampling as S
from divergence.engine.engine import Engine
from divergence.engine.model.forward import StepOutput
from divergence.core.request import Request

ORIGINAL = F.PackedForward.__call__
ORIG_GREEDY = S.greedy_rows
SIZES = {"fixture": dict(prompt=16, long=48, reps=5), "qwen0.5b": dict(prompt=16, long=8, reps=3)}


def _tokens(plan):
    return mx.array(np.concatenate([np.asarray(s.tokens, dtype=np.int32) for s in plan.slices]))


def forward_grouped(self, plan, cache, blocks, dispatch, *, keep_kv=False):
    """One scatter + one gather per layer for all slices; per-sequence RoPE and SDPA."""
    if keep_kv:
        return ORIGINAL(self, plan, cache, blocks, dispatch, keep_kv=keep_kv)
    dispatch.begin_step(plan.index)
    tokens = _tokens(plan)
    w_slots, r_slots, r_off = [], [], [0]
    for s in plan.slices:
        all_slots = blocks.slots(s.request_id, 0, s.start + s.count)
        w_slots.append(all_slots[s.start :])
        r_slots.append(all_slots)
        r_off.append(r_off[-1] + len(all_slots))
    write_all = mx.array(np.concatenate(w_slots))
    read_all = mx.array(np.concatenate(r_slots))
    h = self.inner.embed_tokens(tokens)
    for li, (layer, ops) in enumerate(zip(self.blocks, self.ops)):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_all, k_all, v_all = dispatch(x, ops.q, li), dispatch(x, ops.k, li), dispatch(x, ops.v, li)
        qs, ks = [], []
        for s in plan.slices:
            r0, n = s.row_offset, s.count
            q = q_all[r0 : r0 + n].reshape(1, n, self.n_heads, -1)
            k = k_all[r0 : r0 + n].reshape(1, n, self.n_kv_heads, -1)
            if self.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            qs.append(attn.rope(q.transpose(0, 2, 1, 3), offset=s.start))
            ks.append(attn.rope(k.transpose(0, 2, 1, 3), offset=s.start)[0].transpose(1, 0, 2))
        k_rows = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=0)
        v_rows = v_all.reshape(-1, self.n_kv_heads, self.head_dim)
        cache.write(li, write_all, k_rows, v_rows)
        keys_all, values_all = cache.read(li, read_all)
        outs = []
        for si, s in enumerate(plan.slices):
            a0, a1 = r_off[si], r_off[si + 1]
            keys = keys_all[a0:a1].transpose(1, 0, 2)[None]
            values = values_all[a0:a1].transpose(1, 0, 2)[None]
            o = mx.fast.scaled_dot_product_attention(qs[si], keys, values, scale=self.scale,
                                                     mask="causal" if s.count > 1 else None)
            outs.append(o.transpose(0, 2, 1, 3).reshape(s.count, -1))
        a = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        h = h + dispatch(a, ops.o, li)
        x = layer.post_attention_layernorm(h)
        g, u = dispatch(x, ops.gate, li), dispatch(x, ops.up, li)
        h = h + dispatch(swiglu(g, u), ops.down, li)
    return _head(self, plan, h, dispatch)


def _head(self, plan, h, dispatch):
    rows = [s.row_offset + r for s in plan.slices for r in s.logit_rows]
    hl = h[mx.array(np.asarray(rows, dtype=np.int32))]
    return StepOutput(dispatch(self.inner.norm(hl), self.head, self.num_layers))


def forward_batched(self, plan, cache, blocks, dispatch, *, keep_kv=False):
    """All-decode steps: one RoPE (vector offsets), one scatter, one padded gather, one SDPA per layer."""
    if keep_kv or len(plan.slices) < 2 or any(s.count != 1 for s in plan.slices):
        return ORIGINAL(self, plan, cache, blocks, dispatch, keep_kv=keep_kv)
    dispatch.begin_step(plan.index)
    tokens = _tokens(plan)
    b = len(plan.slices)
    lmax = max(s.start + 1 for s in plan.slices)
    read_idx = np.zeros((b, lmax), dtype=np.int32)
    mask = np.full((b, 1, 1, lmax), -np.inf, dtype=np.float32)
    write = np.zeros(b, dtype=np.int32)
    for i, s in enumerate(plan.slices):
        sl = blocks.slots(s.request_id, 0, s.start + 1)
        read_idx[i, : len(sl)] = sl
        mask[i, ..., : len(sl)] = 0
        write[i] = sl[-1]
    read_idx, write = mx.array(read_idx), mx.array(write)
    mask = mx.array(mask).astype(self.dtype)
    offsets = mx.array(np.asarray([s.start for s in plan.slices], dtype=np.int32))
    h = self.inner.embed_tokens(tokens)
    for li, (layer, ops) in enumerate(zip(self.blocks, self.ops)):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_all, k_all, v_all = dispatch(x, ops.q, li), dispatch(x, ops.k, li), dispatch(x, ops.v, li)
        q = q_all.reshape(b, 1, self.n_heads, -1)
        k = k_all.reshape(b, 1, self.n_kv_heads, -1)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=offsets)  # [b, H, 1, hd]
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=offsets)
        cache.write(li, write, k[:, :, 0, :], v_all.reshape(b, self.n_kv_heads, -1))
        keys, values = cache.read(li, read_idx)  # [b, lmax, kv, hd]
        o = mx.fast.scaled_dot_product_attention(q, keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3),
                                                 scale=self.scale, mask=mask)
        a = o.transpose(0, 2, 1, 3).reshape(b, -1)
        h = h + dispatch(a, ops.o, li)
        x = layer.post_attention_layernorm(h)
        g, u = dispatch(x, ops.gate, li), dispatch(x, ops.up, li)
        h = h + dispatch(swiglu(g, u), ops.down, li)
    return _head(self, plan, h, dispatch)


def forward_block_read(self, plan, cache, blocks, dispatch, *, keep_kv=False):
    """The original per-sequence forward, but K/V are read by block (one index per 16 positions)
    from the pool viewed as [num_blocks, block_size, kv, hd], instead of one index per position."""
    if keep_kv:
        return ORIGINAL(self, plan, cache, blocks, dispatch, keep_kv=keep_kv)
    dispatch.begin_step(plan.index)
    tokens = _tokens(plan)
    bs = blocks.block_size
    write_slots, tables, lens = [], [], []
    for s in plan.slices:
        write_slots.append(mx.array(blocks.slots(s.request_id, s.start, s.start + s.count)))
        n_pos = s.start + s.count
        tables.append(mx.array(np.asarray(blocks.tables[s.request_id][: -(-n_pos // bs)], dtype=np.int32)))
        lens.append(n_pos)
    h = self.inner.embed_tokens(tokens)
    for li, (layer, ops) in enumerate(zip(self.blocks, self.ops)):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_all, k_all, v_all = dispatch(x, ops.q, li), dispatch(x, ops.k, li), dispatch(x, ops.v, li)
        outs = []
        for si, s in enumerate(plan.slices):
            r0, n = s.row_offset, s.count
            q = q_all[r0 : r0 + n].reshape(1, n, self.n_heads, -1)
            k = k_all[r0 : r0 + n].reshape(1, n, self.n_kv_heads, -1)
            v = v_all[r0 : r0 + n].reshape(1, n, self.n_kv_heads, -1)
            if self.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = attn.rope(q.transpose(0, 2, 1, 3), offset=s.start)
            k = attn.rope(k.transpose(0, 2, 1, 3), offset=s.start)
            cache.write(li, write_slots[si], k[0].transpose(1, 0, 2), v[0])
            pool_k = cache.k[li].reshape(-1, bs, self.n_kv_heads, self.head_dim)
            pool_v = cache.v[li].reshape(-1, bs, self.n_kv_heads, self.head_dim)
            keys = pool_k[tables[si]].reshape(-1, self.n_kv_heads, self.head_dim)[: lens[si]]
            values = pool_v[tables[si]].reshape(-1, self.n_kv_heads, self.head_dim)[: lens[si]]
            o = mx.fast.scaled_dot_product_attention(q, keys.transpose(1, 0, 2)[None], values.transpose(1, 0, 2)[None],
                                                     scale=self.scale, mask="causal" if n > 1 else None)
            outs.append(o.transpose(0, 2, 1, 3).reshape(n, -1))
        a = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        h = h + dispatch(a, ops.o, li)
        x = layer.post_attention_layernorm(h)
        g, u = dispatch(x, ops.gate, li), dispatch(x, ops.up, li)
        h = h + dispatch(swiglu(g, u), ops.down, li)
    return _head(self, plan, h, dispatch)


_HEAD_MAJOR: dict = {}


def forward_head_major(self, plan, cache, blocks, dispatch, *, keep_kv=False):
    """The original per-sequence forward with the KV pool stored head-major, [kv, slots, hd]
    (a prototype keeps its own pools next to the engine's): the gathered K/V are already
    in SDPA's [kv, L, hd] layout, no transposed (strided) operands."""
    if keep_kv:
        return ORIGINAL(self, plan, cache, blocks, dispatch, keep_kv=keep_kv)
    key = id(cache)
    if key not in _HEAD_MAJOR:
        _HEAD_MAJOR.clear()
        slots = cache.k[0].shape[0]
        shape = (self.n_kv_heads, slots, self.head_dim)
        _HEAD_MAJOR[key] = ([mx.zeros(shape, self.dtype) for _ in self.blocks],
                            [mx.zeros(shape, self.dtype) for _ in self.blocks])
    pk, pv = _HEAD_MAJOR[key]
    dispatch.begin_step(plan.index)
    tokens = _tokens(plan)
    write_slots, read_slots = [], []
    for s in plan.slices:
        all_slots = blocks.slots(s.request_id, 0, s.start + s.count)
        write_slots.append(mx.array(all_slots[s.start :]))
        read_slots.append(mx.array(all_slots))
    h = self.inner.embed_tokens(tokens)
    for li, (layer, ops) in enumerate(zip(self.blocks, self.ops)):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_all, k_all, v_all = dispatch(x, ops.q, li), dispatch(x, ops.k, li), dispatch(x, ops.v, li)
        outs = []
        for si, s in enumerate(plan.slices):
            r0, n = s.row_offset, s.count
            q = q_all[r0 : r0 + n].reshape(1, n, self.n_heads, -1)
            k = k_all[r0 : r0 + n].reshape(1, n, self.n_kv_heads, -1)
            v = v_all[r0 : r0 + n].reshape(1, n, self.n_kv_heads, -1)
            if self.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = attn.rope(q.transpose(0, 2, 1, 3), offset=s.start)
            k = attn.rope(k.transpose(0, 2, 1, 3), offset=s.start)
            pk[li][:, write_slots[si]] = k[0]
            pv[li][:, write_slots[si]] = v[0].transpose(1, 0, 2)
            keys, values = pk[li][:, read_slots[si]][None], pv[li][:, read_slots[si]][None]
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale,
                                                     mask="causal" if n > 1 else None)
            outs.append(o.transpose(0, 2, 1, 3).reshape(n, -1))
        a = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        h = h + dispatch(a, ops.o, li)
        x = layer.post_attention_layernorm(h)
        g, u = dispatch(x, ops.gate, li), dispatch(x, ops.up, li)
        h = h + dispatch(swiglu(g, u), ops.down, li)
    mx.eval(pk, pv)
    return _head(self, plan, h, dispatch)


def greedy_batched(logits):
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


VARIANTS = {
    "original": (ORIGINAL, ORIG_GREEDY),
    "grouped": (forward_grouped, ORIG_GREEDY),
    "batched": (forward_batched, ORIG_GREEDY),
    "batched+greedy": (forward_batched, greedy_batched),
    "block-read": (forward_block_read, ORIG_GREEDY),
    "head-major": (forward_head_major, ORIG_GREEDY),
}


CLOCK = C.Clock()


def run(eng, prompts, n, variant):
    """Median ms per decode step (step timestamps after the last prefill step) and the tokens."""
    fwd, greedy = VARIANTS[variant]
    F.PackedForward.__call__, S.greedy_rows = fwd, greedy
    try:
        reqs = [Request(f"r{i}", tuple(p), max_tokens=n) for i, p in enumerate(prompts)]
        C.sync()
        t0 = time.perf_counter()
        res = eng.run(reqs, "concurrent")
        sp = CLOCK.split()
        return sp["step_s_median"] * 1000, [res.outputs[r.id].tokens for r in reqs]
    finally:
        F.PackedForward.__call__, S.greedy_rows = ORIGINAL, ORIG_GREEDY


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="fixture,qwen0.5b")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=None, help="prompt length (context) override")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--target", default=None)
    ap.add_argument("--model-cache", default=None)
    ap.add_argument("--out", default=str(C.RESULTS / "ablate_forward.json"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the other (model, dtype, B, context) entries already in --out")
    a = ap.parse_args()
    meta = C.meta(a)  # at the start: the engine commit that was measured
    t_all = time.perf_counter()
    target, _, where = C.fixture_paths(a.target, None)
    results, rows = [], []
    for name in a.models.split(","):
        path = target if name == "fixture" else C.qwen_path(target, a.model_cache)
        sz = dict(SIZES[name])
        if a.prompt:
            sz["prompt"] = a.prompt
        variants = [v.strip() for v in a.variants.split(",")]
        for dtype in a.dtypes.split(","):
            t = C.load(path, dtype)
            eng = Engine(t, policy="native", stop_at_eos=False, token_budget=max(256, sz["prompt"] * 8),
                         observers=[CLOCK])
            eng.run([Request("w", (1, 2, 3), max_tokens=2)], "serial")
            for b in [int(x) for x in a.batches.split(",")]:
                ps = C.prompts(t.encode, b, sz["prompt"])
                per = {v: [] for v in variants}
                toks = {}
                for rep in range(sz["reps"]):
                    order = variants if rep % 2 == 0 else variants[::-1]
                    for v in order:
                        ms, toks[v] = run(eng, ps, sz["long"], v)
                        per[v].append(ms)
                base = per["original"]
                r = {"model": name, "dtype": t.dtype, "B": b, "prompt": sz["prompt"], "variants": {}}
                for v in variants:
                    r["variants"][v] = {"ms_per_step": C.summary(per[v]),
                                        "speedup_vs_original": C.paired_ratio(base, per[v]),
                                        "tokens_equal_original": sum(x == y for x, y in zip(toks[v], toks["original"]))}
                results.append(r)
                print(f"   {name} {t.dtype} B={b}: " + ", ".join(f"{v} {C.med(per[v]):.2f}" for v in variants)
                      + " ms/step", flush=True)
            del eng, t
    if a.merge:
        results = C.merge_results(a.out, results, lambda r: (r["model"], r["dtype"], r["B"], r["prompt"]))
    for r in results:
        for v, x in r["variants"].items():
            rows.append([r["model"], r["dtype"], r["B"], r["prompt"], v, C.fmt(x["ms_per_step"]["median"]),
                         C.fmt(x["speedup_vs_original"]), f"{x['tokens_equal_original']}/{r['B']}"])
    txt = C.table(rows, ["model", "dtype", "B", "context", "variant", "ms/decode step", "speedup", "same tokens"])
    print("\n" + txt)
    C.write_json(Path(a.out), {"meta": meta, "fixture_source": where, "results": results,
                               "table": txt.splitlines(), "seconds": time.perf_counter() - t_all})
    print(f"[bench] total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()

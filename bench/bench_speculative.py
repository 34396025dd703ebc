"""Speculative decoding and prefix caching benchmarks, side by side with mlx-lm.

    python bench/bench_speculative.py                # fixture pair, bfloat16 + float32, k=1..6, prefix cache
    python bench/bench_speculative.py --quick        # fewer tokens, 3 repetitions, fixture only
    python bench/bench_speculative.py --ks 1,2,4 --dtypes bfloat16 --prefix-models fixture,qwen0.5b

Speculative: for each k the engine (Engine(target, draft, spec_k=k), greedy,
one request at a time) and mlx-lm's `speculative_generate_step` (same models,
same prompts, num_draft_tokens=k) run interleaved; k=0 is plain decoding (the
engine without a draft, mlx-lm `generate_step`). Reported per k: tok/s (end to
end, prompt included), speedup over the same implementation's k=0, acceptance
rate (accepted / proposed draft tokens), tokens per target forward, and the
engine / mlx-lm tok/s ratio.

Prefix cache: R requests share a long system prompt and differ in a short
suffix; the engine runs them with prefix_caching on and off (interleaved).
Reported: hit rate (prompt tokens served from the cache / prompt tokens looked
up, read from the engine's `arrived` events), prefill rows computed, time of
the steps that ran prefill rows, wall time, and whether outputs match.

Writes bench/results/speculative.json.
"""
from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import common as C  # noqa: I001  (first: sys.path + BLAS before mlx)
from common import mx

from mlx_lm.generate import generate_step, speculative_generate_step

from divergence.engine.engine import Engine
from divergence.core.request import Request

SPEC = dict(prompts=4, prompt=24, tokens=64, reps=3)
SPEC_QUICK = dict(prompts=1, prompt=16, tokens=8, reps=1)  # a check, not a measurement
# Shared-system-prompt workload per model: system prompt, user suffix, requests, generated tokens.
PREFIX = {
    "fixture": dict(system=256, suffix=16, requests=8, tokens=8, reps=5),
    "qwen0.5b": dict(system=128, suffix=8, requests=4, tokens=2, reps=3),
}
PREFIX_QUICK = {
    "fixture": dict(system=32, suffix=8, requests=2, tokens=2, reps=1),
    "qwen0.5b": dict(system=64, suffix=8, requests=3, tokens=2, reps=3),
}


# -- speculative -----------------------------------------------------------------------------
def engine_spec(eng: Engine, clock: C.Clock, prompts, n: int) -> dict:
    reqs = [Request(f"r{i}", tuple(p), max_tokens=n) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    res = eng.run(reqs, "serial")
    wall = time.perf_counter() - t0
    outs = [res.outputs[r.id] for r in reqs]
    proposed = sum(o.proposed for o in outs)
    accepted = sum(o.accepted for o in outs)
    decode_fwd = sum(1 for s in clock.steps if s.model == "target" and not s.prefill)
    gen = sum(len(o.tokens) for o in outs)
    return {
        "wall_s": wall,
        "tok_s": gen / wall,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": accepted / proposed if proposed else None,
        "target_forwards": decode_fwd,
        "tokens_per_target_forward": (gen - len(outs)) / decode_fwd if decode_fwd else None,
        "tokens": [o.tokens for o in outs],
    }


def mlx_spec(target, draft, prompts, n: int, k: int) -> dict:
    toks_all, proposed, accepted, rounds = [], 0, 0, 0
    C.sync()
    t0 = time.perf_counter()
    for p in prompts:
        toks = []
        if k == 0:
            for tok, _ in generate_step(mx.array(p), target, max_tokens=n):
                toks.append(int(tok))
            rounds += n - 1
        else:
            open_round = False
            for tok, _, from_draft in speculative_generate_step(mx.array(p), target, draft, num_draft_tokens=k,
                                                                max_tokens=n):
                if not open_round:  # a round proposes min(k, tokens left) draft tokens
                    proposed += min(k, n - len(toks))
                    rounds += 1
                    open_round = True
                toks.append(int(tok))
                if from_draft:
                    accepted += 1
                else:
                    open_round = False
        toks_all.append(toks)
    C.sync()
    wall = time.perf_counter() - t0
    gen = sum(len(t) for t in toks_all)
    return {
        "wall_s": wall,
        "tok_s": gen / wall,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": accepted / proposed if proposed else None,
        "target_forwards": rounds,
        "tokens_per_target_forward": gen / rounds if rounds else None,  # includes the prefill round's token
        "tokens": toks_all,
    }


def bench_spec(tpath, dpath, dtype: str, ks: list[int], sz: dict) -> dict:
    t0 = time.perf_counter()
    t, d = C.load(tpath, dtype), C.load(dpath, dtype)
    print(f"\n== speculative: fixture pair {t.dtype} (target {C.num_params(t) / 1e6:.1f}M, "
          f"draft {C.num_params(d) / 1e6:.2f}M), k={ks}", flush=True)
    ps = C.prompts(t.encode, sz["prompts"], sz["prompt"], stride=101)
    clock = C.Clock()
    engines = {k: Engine(t, d if k else None, spec_k=k, policy="native", stop_at_eos=False, observers=[clock])
               for k in [0] + ks}
    for k, e in engines.items():  # warm-up
        e.run([Request("w", tuple(ps[0][:8]), max_tokens=4)], "serial")
        mlx_spec(t.model, d.model, [ps[0][:8]], 4, k)
    runs = {k: {"engine": [], "mlx_lm": []} for k in [0] + ks}
    for rep in range(sz["reps"]):
        for i, k in enumerate([0] + ks):
            jobs = [("engine", lambda k=k: engine_spec(engines[k], clock, ps, sz["tokens"])),
                    ("mlx_lm", lambda k=k: mlx_spec(t.model, d.model, ps, sz["tokens"], k))]
            for who, fn in (jobs[::-1] if (rep + i) % 2 else jobs):
                runs[k][who].append(fn())
        print(f"   rep {rep + 1}/{sz['reps']}: " + ", ".join(
            f"k={k} {C.fmt(runs[k]['engine'][-1]['tok_s'])}/{C.fmt(runs[k]['mlx_lm'][-1]['tok_s'])}"
            for k in [0] + ks) + " tok/s (engine/mlx-lm)", flush=True)

    base = {who: [r["tok_s"] for r in runs[0][who]] for who in ("engine", "mlx_lm")}
    ref_tokens = {who: runs[0][who][0]["tokens"] for who in ("engine", "mlx_lm")}
    out = {"dtype": t.dtype, "target": str(tpath), "draft": str(dpath), "sizes": sz, "k": {}}
    for k in [0] + ks:
        row = {}
        for who in ("engine", "mlx_lm"):
            rs = runs[k][who]
            tps = [r["tok_s"] for r in rs]
            row[who] = {
                "tok_s": C.summary(tps),
                "speedup_vs_k0": C.paired_ratio(tps, base[who]),
                "acceptance": rs[0]["acceptance"],
                "proposed": rs[0]["proposed"],
                "accepted": rs[0]["accepted"],
                "tokens_per_target_forward": rs[0]["tokens_per_target_forward"],
                "same_tokens_as_k0": sum(a == b for a, b in zip(rs[0]["tokens"], ref_tokens[who])),
            }
        row["ratio_engine_vs_mlx_lm"] = C.paired_ratio([r["tok_s"] for r in runs[k]["engine"]],
                                                       [r["tok_s"] for r in runs[k]["mlx_lm"]])
        row["engine_tokens_equal_mlx_lm"] = sum(a == b for a, b in zip(runs[k]["engine"][0]["tokens"],
                                                                       runs[k]["mlx_lm"][0]["tokens"]))
        row["requests"] = len(ps)
        out["k"][str(k)] = row
    out["seconds"] = time.perf_counter() - t0
    del engines, t, d
    gc.collect()
    mx.clear_cache()
    return out


# -- prefix cache -----------------------------------------------------------------------------
def engine_prefix(eng: Engine, clock: C.Clock, reqs, schedule: str) -> dict:
    C.sync()
    t0 = time.perf_counter()
    res = eng.run(reqs, schedule)
    wall = time.perf_counter() - t0
    sp = clock.split()
    lookups = sum(len(r.prompt_tokens) for r in reqs)
    hits = sum(clock.hits.values())
    return {
        "wall_s": wall,
        "hits": hits,
        "lookups": lookups,
        "hit_rate": hits / lookups,
        "prefill_rows": sp["prefill_rows"],
        "prefill_step_s": sp["prefill_forward_s"],
        "tokens": [res.outputs[r.id].tokens for r in reqs],
    }


def bench_prefix(name: str, path, dtype: str, sz: dict) -> dict:
    t0 = time.perf_counter()
    t = C.load(path, dtype)
    print(f"\n== prefix cache: {name} {t.dtype}: {sz['requests']} requests = {sz['system']}-token shared "
          f"system prompt + {sz['suffix']}-token suffix, {sz['tokens']} tokens each", flush=True)
    system = C.prompts(t.encode, 1, sz["system"])[0]
    suffixes = C.prompts(t.encode, sz["requests"], sz["suffix"], stride=53)
    stagger = 2  # concurrent: the first request arrives at step 0, the rest at step 2 (after its prefill)
    workloads = {
        "serial": ("serial", [Request(f"r{i}", tuple(system + s), max_tokens=sz["tokens"])
                              for i, s in enumerate(suffixes)]),
        "concurrent_all_at_0": ("concurrent", [Request(f"r{i}", tuple(system + s), max_tokens=sz["tokens"])
                                               for i, s in enumerate(suffixes)]),
        "concurrent_staggered": ("concurrent", [Request(f"r{i}", tuple(system + s), max_tokens=sz["tokens"],
                                                        arrival=0 if i == 0 else stagger)
                                                for i, s in enumerate(suffixes)]),
    }
    if name != "fixture":  # big models: the serial workload only (time)
        workloads = {"serial": workloads["serial"]}
    clock = C.Clock()
    engines = {on: Engine(t, policy="native", stop_at_eos=False, prefix_caching=on, observers=[clock])
               for on in (False, True)}
    for e in engines.values():
        e.run([Request("w", tuple(system[:20]), max_tokens=2)], "serial")
    runs = {w: {on: [] for on in (False, True)} for w in workloads}
    for rep in range(sz["reps"]):
        for i, (w, (sched, reqs)) in enumerate(workloads.items()):
            order = (False, True) if (rep + i) % 2 == 0 else (True, False)
            for on in order:
                runs[w][on].append(engine_prefix(engines[on], clock, reqs, sched))
        s = runs["serial"]
        print(f"   rep {rep + 1}/{sz['reps']}: serial wall off {s[False][-1]['wall_s']:.2f}s on {s[True][-1]['wall_s']:.2f}s,"
              f" hit rate {s[True][-1]['hit_rate']:.2f}", flush=True)
    out = {"model": name, "dtype": t.dtype, "path": str(path), "sizes": sz, "workloads": {}}
    for w in workloads:
        off, on = runs[w][False], runs[w][True]
        pf_off, pf_on = [r["prefill_step_s"] for r in off], [r["prefill_step_s"] for r in on]
        wl_off, wl_on = [r["wall_s"] for r in off], [r["wall_s"] for r in on]
        out["workloads"][w] = {
            "schedule": workloads[w][0],
            "hit_rate": on[0]["hit_rate"],
            "hits": on[0]["hits"],
            "lookups": on[0]["lookups"],
            "hit_rate_without_prefix_caching": off[0]["hit_rate"],
            "prefill_rows": {"off": off[0]["prefill_rows"], "on": on[0]["prefill_rows"]},
            "prefill_step_s": {"off": C.summary(pf_off), "on": C.summary(pf_on)},
            "prefill_time_saved_s": C.med([a - b for a, b in zip(pf_off, pf_on)]),
            "prefill_time_saved_frac": C.med([1 - b / a for a, b in zip(pf_off, pf_on) if a]),
            "wall_s": {"off": C.summary(wl_off), "on": C.summary(wl_on)},
            "wall_speedup": C.paired_ratio(wl_off, wl_on),
            "outputs_equal": sum(a == b for a, b in zip(off[0]["tokens"], on[0]["tokens"])),
            "requests": len(on[0]["tokens"]),
        }
    out["seconds"] = time.perf_counter() - t0
    del engines, t
    gc.collect()
    mx.clear_cache()
    return out


# -- report ------------------------------------------------------------------------------------
def print_tables(spec: list[dict], prefix: list[dict]) -> str:
    lines = []
    rows = []
    for s in spec:
        for k, r in s["k"].items():
            e, m = r["engine"], r["mlx_lm"]
            rows.append([s["dtype"], k, C.fmt(e["tok_s"]["median"]), C.fmt(e["speedup_vs_k0"]),
                         C.fmt(e["acceptance"]), C.fmt(e["tokens_per_target_forward"]),
                         C.fmt(m["tok_s"]["median"]), C.fmt(m["speedup_vs_k0"]), C.fmt(m["acceptance"]),
                         C.fmt(m["tokens_per_target_forward"]), C.fmt(r["ratio_engine_vs_mlx_lm"]),
                         f"{e['same_tokens_as_k0']}/{r['requests']}", f"{r['engine_tokens_equal_mlx_lm']}/{r['requests']}"])
    if rows:
        lines.append(C.table(rows, ["dtype", "k", "eng tok/s", "eng speedup", "eng accept", "eng tok/fwd",
                                    "mlx tok/s", "mlx speedup", "mlx accept", "mlx tok/fwd", "eng/mlx",
                                    "eng = k0", "eng = mlx"]))
    rows = []
    for p in prefix:
        for w, r in p["workloads"].items():
            rows.append([p["model"], p["dtype"], w, C.fmt(r["hit_rate"]),
                         f"{r['prefill_rows']['off']} -> {r['prefill_rows']['on']}",
                         f"{C.fmt(r['prefill_step_s']['off']['median'], 3)} -> {C.fmt(r['prefill_step_s']['on']['median'], 3)}",
                         C.fmt(r["prefill_time_saved_s"], 3), C.fmt(r["prefill_time_saved_frac"]),
                         f"{C.fmt(r['wall_s']['off']['median'], 3)} -> {C.fmt(r['wall_s']['on']['median'], 3)}",
                         C.fmt(r["wall_speedup"]), f"{r['outputs_equal']}/{r['requests']}"])
    if rows:
        lines.append(C.table(rows, ["model", "dtype", "workload", "hit rate", "prefill rows off->on",
                                    "prefill step s off->on", "saved s", "saved frac", "wall s off->on",
                                    "wall speedup", "same out"]))
    txt = "\n\n".join(lines)
    print("\n" + txt)
    return txt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default=None, help="draft lengths k to measure (default 1,2,3,4,5,6; --quick: 2,4)")
    ap.add_argument("--dtypes", default=None, help="dtypes of the speculative runs (default bfloat16,float32; --quick: float32)")
    ap.add_argument("--prefix-models", default=None,
                    help="models of the prefix-cache workload (default fixture,qwen0.5b; --quick: fixture)")
    ap.add_argument("--prefix-dtype", default="float32", help="dtype of the prefix-cache runs")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and prompts, 3 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (>= 3)")
    ap.add_argument("--tokens", type=int, default=None, help="generated tokens per request (speculative)")
    ap.add_argument("--skip-spec", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--model-cache", default=None, help="where the random qwen0.5b model is generated/reused")
    ap.add_argument("--out", default=None, help="default bench/results/speculative.json (--quick: a temp dir)")
    a = ap.parse_args()
    a.ks = a.ks or ("2" if a.quick else "1,2,3,4,5,6")
    a.dtypes = a.dtypes or ("float32" if a.quick else "bfloat16,float32")
    a.out = C.out_path("speculative", a.quick, a.out)
    meta = C.meta(a)  # at the start: the engine commit that was measured
    t_all = time.perf_counter()
    target, draft, where = C.fixture_paths(a.target, a.draft)
    print(f"[bench] fixture pair: {target}, {draft} ({where}); BLAS: {meta['blas']}")
    ks = [int(x) for x in a.ks.split(",") if x.strip()]
    spec = []
    if not a.skip_spec:
        for dtype in a.dtypes.split(","):
            sz = dict(SPEC_QUICK if a.quick else SPEC)
            if a.reps:
                sz["reps"] = max(3, a.reps)
            if a.tokens:
                sz["tokens"] = a.tokens
            spec.append(bench_spec(target, draft, dtype.strip(), ks, sz))
    prefix = []
    if not a.skip_prefix:
        models = a.prefix_models or ("fixture" if a.quick else "fixture,qwen0.5b")
        for name in models.split(","):
            name = name.strip()
            sz = dict((PREFIX_QUICK if a.quick else PREFIX)[name])
            if a.reps:
                sz["reps"] = max(3, a.reps)
            path = target if name == "fixture" else C.qwen_path(target, a.model_cache)
            prefix.append(bench_prefix(name, path, a.prefix_dtype, sz))
    txt = print_tables(spec, prefix)
    data = {
        "meta": meta, "fixture_source": where, "speculative": spec, "prefix_cache": prefix,
        "prefix_cache_note": ("hits are read from the engine's RequestEvent('arrived', detail='prefix_hit=N'); "
                              "BlockManager.hits/.lookups live on the per-run state (_Run.target.blocks), which "
                              "Engine.run does not return. lookups = sum of prompt lengths, as BlockManager counts."),
        "table": txt.splitlines(), "seconds": time.perf_counter() - t_all,
    }
    C.write_json(Path(a.out), data)
    print(f"[bench] total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()

"""TP=2 vs TP=1 on this machine: engine throughput and the all-reduce's share.

    python bench/bench_tp.py                         # fixture, float32 + bfloat16
    python bench/bench_tp.py --models fixture,qwen0.5b --reps 5

Starts two ranks (divergence's launcher: ring backend over 127.0.0.1). In every
repetition, in rotating order: TP=2 (both ranks), TP=2 with the all-reduce replaced
by nothing (the same sharded work, no communication: wrong numbers, same shapes,
because --ignore-eos fixes every run's length), and TP=1 on rank 0 alone (rank 1
sleeps on a file, not in a collective, so it takes no CPU). Reported: tok/s of each,
the paired ratio TP=2 / TP=1, and the all-reduce share of a TP=2 run measured two
ways: in place, (t_tp2 - t_tp2_without_allreduce) / t_tp2, which includes waiting for
the slower rank; and isolated, every all-reduce of the run timed alone at its size,
summed, over t_tp2. Writes bench/results/tp.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="float32 only, 8 tokens per request")
    p.add_argument("--models", default="fixture", help="comma list: fixture, qwen0.5b")
    p.add_argument("--dtypes", default=None, help="default float32,bfloat16 (--quick: float32)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="requests per run (concurrent schedule)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=None, help="default 24 (--quick: 8)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/tp.json; --quick: a temp dir)")
    p.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)  # set for the ranks by the parent
    a = p.parse_args(argv)
    a.dtypes = a.dtypes or ("float32" if a.quick else "float32,bfloat16")
    a.max_tokens = a.max_tokens or (4 if a.quick else 24)
    if a.quick:  # a check that it runs, not a measurement
        a.reps, a.batch, a.prompt_len = 1, 2, 8
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_out:
        return rank_main(args)
    import common
    from divergence.parallel.launch import launch

    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-tp-{os.getpid()}.json"
    argv = list(sys.argv[1:] if argv is None else argv)
    rc = launch([sys.executable, str(Path(__file__).resolve()), *argv, "--rank-out", str(tmp)], 2,
                label="bench_tp", env={"PYTHONPATH": str(common.ROOT)})
    if rc != 0:
        return rc
    data = json.loads(tmp.read_text())
    tmp.unlink()
    data["meta"] = common.meta(args)
    out = common.out_path("tp", args.quick, args.out)
    common.write_json(out, data)
    rows = [[r["model"], r["dtype"], common.fmt(r["tp1_tok_s"]["median"]), common.fmt(r["tp2_tok_s"]["median"]),
             common.fmt(r["tp2_over_tp1"]), f"{r['allreduce_share_in_place'] * 100:.0f}%",
             f"{r['allreduce_share_isolated'] * 100:.0f}%", r["allreduces_per_run"], r["same_tokens"]]
            for r in data["results"]]
    print(common.table(rows, ["model", "dtype", "TP=1 tok/s", "TP=2 tok/s", "TP=2/TP=1", "all-reduce share",
                              "isolated", "all-reduces", "same tokens"]))
    return 0


def rank_main(args) -> int:
    import common  # noqa: F401  (BLAS before mlx)
    import mlx.core as mx

    from divergence.core.events import Observer
    from divergence.core.request import Request
    from divergence.parallel import env as tpenv, group as tpmod
    from divergence.engine.engine import Engine

    tp = tpmod.init_from_env(expected=2)
    flags = Path(os.environ[tpenv.DIR_ENV])

    class Counter(Observer):
        wants_kernels = True  # all-reduces go out with the kernel choices, only to observers that ask

        def __init__(self):
            self.sizes: list[int] = []

        def on_allreduce(self, e):
            self.sizes.append(e.bytes)

    class NoReduce(tpmod.TensorParallel):  # the partial sums, not added: what the all-reduce costs
        def reduce_partial(self, dispatch, out, op, layer):
            return out, tpmod.AllReduce(dispatch.step, dispatch.model, layer, op.name, self.size, int(out.nbytes),
                                        self.backend)

    def barrier():
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=tp.group))

    results = []
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            path = _model_path(model)
            loaded = common.load(path, dtype)
            reqs = [Request(f"r{i}", tuple(p), max_tokens=args.max_tokens)
                    for i, p in enumerate(common.prompts(loaded.encode, args.batch, args.prompt_len))]
            e2 = Engine(loaded, tp=tp, stop_at_eos=False)
            e2n = Engine(loaded, tp=NoReduce(tp.group, tp.backend, tp.world, tp.launcher), stop_at_eos=False)
            e1 = Engine(loaded, stop_at_eos=False) if tp.rank == 0 else None
            counter = Counter()
            times = {"tp1": [], "tp2": [], "tp2_no_allreduce": []}
            tokens = {}

            def run(name, rep):
                if name == "tp1":
                    if tp.rank == 0:
                        t0 = time.perf_counter()
                        res = e1.run(reqs, "concurrent")
                        times["tp1"].append(time.perf_counter() - t0)
                        tokens["tp1"] = {k: v.tokens for k, v in res.outputs.items()}
                        (flags / f"tp1.{model}.{dtype}.{rep}").touch()
                    else:
                        while not (flags / f"tp1.{model}.{dtype}.{rep}").exists():
                            time.sleep(0.005)
                    return
                eng = e2 if name == "tp2" else e2n
                eng.observers = [counter] if rep < 0 else []  # counted in the warm-up, not timed
                barrier()
                t0 = time.perf_counter()
                res = eng.run(reqs, "concurrent")
                barrier()
                times[name].append(time.perf_counter() - t0)
                if name == "tp2":
                    tokens["tp2"] = {k: v.tokens for k, v in res.outputs.items()}

            order = ["tp2", "tp2_no_allreduce", "tp1"]
            run("tp2", -1)  # warm-up (first runs build caches); not timed below
            run("tp1", -1)
            for k in times:
                times[k].clear()
            for rep in range(args.reps):
                for name in order[rep % 3:] + order[:rep % 3]:
                    run(name, rep)
            isolated = _isolated_allreduce_s(tp, counter.sizes, dtype)
            if tp.rank == 0:
                n_tok = args.batch * args.max_tokens
                t1, t2, t2n = times["tp1"], times["tp2"], times["tp2_no_allreduce"]
                share = [(a - b) / a for a, b in zip(t2, t2n)]
                results.append({
                    "model": model, "dtype": dtype, "batch": args.batch, "prompt_len": args.prompt_len,
                    "max_tokens": args.max_tokens, "reps": args.reps,
                    "tp1_s": common.summary(t1), "tp2_s": common.summary(t2),
                    "tp2_no_allreduce_s": common.summary(t2n),
                    "tp1_tok_s": common.summary([n_tok / t for t in t1]),
                    "tp2_tok_s": common.summary([n_tok / t for t in t2]),
                    "tp2_over_tp1": common.paired_ratio([n_tok / t for t in t2], [n_tok / t for t in t1]),
                    "allreduce_share_in_place": common.med(share),
                    "allreduce_share_samples": share,
                    "allreduces_per_run": len(counter.sizes),
                    "allreduce_bytes_per_run": sum(counter.sizes),
                    "allreduce_isolated_s": isolated,
                    "allreduce_share_isolated": isolated / common.med(t2),
                    "same_tokens": sum(tokens["tp1"][k] == tokens["tp2"][k] for k in tokens["tp1"]),
                })
                print(f"[bench] {model} {dtype}: TP=1 {common.med(t1):.2f} s, TP=2 {common.med(t2):.2f} s, "
                      f"TP=2 without all-reduce {common.med(t2n):.2f} s", flush=True)
    if tp.rank == 0:
        Path(args.rank_out).write_text(json.dumps({
            "note": "2 ranks on one machine over loopback (ring); wall time of Engine.run (concurrent "
                    "schedule), medians over reps; ratios are medians of paired per-rep ratios",
            "tp": tp.describe(), "load_average": os.getloadavg(), "results": results}))
    return 0


def _isolated_allreduce_s(tp, sizes: list[int], dtype: str) -> float:
    """Seconds of the run's all-reduces timed alone, each at its message size (median of 3
    batches of 10)."""
    import statistics

    import mlx.core as mx

    from divergence.engine.model.loading import DTYPES

    dt = DTYPES[dtype]
    per: dict[int, float] = {}
    for b in sorted(set(sizes)):
        x = mx.ones((b // dt.size,), dtype=dt)
        mx.eval(x)
        ts = []
        for _ in range(3):  # 10 back to back: one rank's wake-up latency is not the reduction's cost
            mx.eval(mx.distributed.all_sum(x, group=tp.group))
            t0 = time.perf_counter()
            for _ in range(10):
                mx.eval(mx.distributed.all_sum(x, group=tp.group))
            ts.append((time.perf_counter() - t0) / 10)
        per[b] = statistics.median(ts)
    return sum(per[b] for b in sizes)


def _model_path(name: str):
    import common

    if name == "fixture":
        return common.fixture_paths()[0]
    if name == "qwen0.5b":
        return common.qwen_path(common.fixture_paths()[0])
    raise SystemExit(f"unknown model {name!r} (fixture, qwen0.5b)")


if __name__ == "__main__":
    sys.exit(main())

"""Shared helpers of the benchmark scripts: model resolution, prompts, timing, stats, output.

Import this module first: it puts the repository on sys.path and imports
`divergence.engine.model.loading`, which loads the optimized BLAS before MLX.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import divergence.engine.model.loading as dmodel  # noqa: E402  (loads OpenBLAS before mlx)

try:  # prompts are windows of a long text: silence the tokenizer's max-length notice
    from transformers.utils import logging as _hf_logging

    _hf_logging.set_verbosity_error()
except Exception:  # pragma: no cover
    pass
import mlx.core as mx  # noqa: E402

from divergence.core.events import PREFILL, TARGET, Observer  # noqa: E402

# Shapes of the models the scripts know (the fixture's are read from its config).
QWEN05B = dict(model_type="qwen2", hidden_size=896, num_layers=24, heads=14, kv_heads=2,
               intermediate_size=4864, vocab_size=151936, tie=True)
SMOKE_TARGET = Path("/tmp/smoke/target")
SMOKE_DRAFT = Path("/tmp/smoke/draft")


def _is_model_dir(p) -> bool:
    p = Path(p)
    return (p / "config.json").exists() and any(p.glob("*.safetensors"))


def fixture_paths(target=None, draft=None) -> tuple[Path, Path, str]:
    """(target, draft, where): the embedded fixtures when they exist, else the smoke copies."""
    if target:
        return Path(target), Path(draft) if draft else SMOKE_DRAFT, "given on the command line"
    try:
        from divergence.fixtures import DRAFT, TARGET as FT  # type: ignore

        if _is_model_dir(FT) and _is_model_dir(DRAFT):
            return Path(FT), Path(DRAFT), "divergence.fixtures"
    except Exception:
        pass
    t, d = ROOT / "fixtures" / "target", ROOT / "fixtures" / "draft"
    if _is_model_dir(t) and _is_model_dir(d):
        return t, d, "fixtures/ folder"
    if _is_model_dir(SMOKE_TARGET) and _is_model_dir(SMOKE_DRAFT):
        return SMOKE_TARGET, SMOKE_DRAFT, "smoke copies in /tmp/smoke (fixtures not landed yet)"
    raise SystemExit("no fixture models found (divergence.fixtures, fixtures/, /tmp/smoke); pass --target/--draft")


def qwen_path(tokenizer_from: Path, cache_dir=None, regen: bool = False, bits: int | None = None) -> Path:
    """A random Qwen2.5-0.5B-shaped bf16 model (bits=4: quantized, group 32), generated once
    into a temp dir and reused."""
    from divergence.testing.models import make_random_model

    base = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "divergence-bench"
    path = base / ("qwen0.5b-random-bf16" + (f"-{bits}bit" if bits else ""))
    if regen or not _is_model_dir(path):
        t0 = time.perf_counter()
        print(f"[bench] generating the random Qwen2.5-0.5B-shaped model into {path} ...", flush=True)
        make_random_model(path, dtype="bfloat16", tokenizer_from=tokenizer_from,
                          max_position_embeddings=32768, quantize_bits=bits, **QWEN05B)
        print(f"[bench]   done in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def truncated_model(src: Path, out: Path, layers: int) -> Path:
    """A draft made from a model: its first `layers` layers, with its own embedding, final
    norm and head (the self-speculative "layer skip" draft). A random target has no small
    sibling trained with it; its truncation shares its vocabulary and, with the residual
    stream, much of its argmax, so a draft pair exists for any target. Written once."""
    out = Path(out)
    if _is_model_dir(out):
        return out
    import re as _re
    import shutil as _shutil

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    weights = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            m = _re.search(r"layers\.(\d+)\.", k)
            if m is None or int(m.group(1)) < layers:
                weights[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            _shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def model_path(name: str, target: Path, cache_dir=None) -> Path:
    """fixture | fixture-4bit | qwen0.5b | qwen0.5b-4bit -> a model directory."""
    if name == "fixture":
        return target
    if name == "fixture-4bit":
        return target.parent / "target-4bit"
    if name in ("qwen0.5b", "qwen0.5b-4bit"):
        return qwen_path(target, cache_dir, bits=4 if name.endswith("4bit") else None)
    raise SystemExit(f"unknown model {name!r} (expected fixture, fixture-4bit, qwen0.5b or qwen0.5b-4bit)")


def load(path, dtype):
    mx.clear_cache()
    return dmodel.load_model(path, dtype=dtype)


def num_params(loaded) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(loaded.model.parameters()))


# -- prompts -------------------------------------------------------------------------
_CORPUS_OBJS = ("list", "dict", "str", "sorted", "len", "zip", "open", "int", "range", "set", "bytes")


def token_stream(encode, min_len: int) -> list[int]:
    """Real text (standard-library docstrings, what the fixture was trained on), as token ids."""
    import builtins
    import json as _json
    import os.path as _osp

    from divergence.workloads.prompts import DEMO_R2_PROMPT

    texts = [DEMO_R2_PROMPT] + [getattr(builtins, n).__doc__ or "" for n in _CORPUS_OBJS]
    texts += [_json.dumps.__doc__ or "", _osp.join.__doc__ or "", _json.loads.__doc__ or ""]
    toks: list[int] = []
    while len(toks) < min_len:
        for t in texts:
            toks += encode(t)
    return toks


def prompts(encode, n: int, length: int, stride: int = 37) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens (windows of one text at different offsets)."""
    s = token_stream(encode, n * stride + length + 1)
    return [s[i * stride : i * stride + length] for i in range(n)]


# -- timing --------------------------------------------------------------------------
@dataclass
class StepRec:
    t: float  # perf_counter when the step closed
    model: str
    prefill: bool
    rows: int
    prefill_rows: int
    tokens: int  # tokens committed in this step
    duration: float  # the engine's own forward+eval time of the step


@dataclass
class Clock(Observer):
    """Wall-clock timestamps of each engine step, tokens per step, prefix-cache hits."""

    t0: float = 0.0
    steps: list = field(default_factory=list)
    hits: dict = field(default_factory=dict)
    _pending: int = 0

    def on_run_start(self, info) -> None:
        self.t0 = time.perf_counter()
        self.steps, self.hits, self._pending = [], {}, 0

    def on_token(self, event) -> None:
        self._pending += 1

    def on_request(self, event) -> None:
        if event.kind == "arrived" and event.detail.startswith("prefix_hit="):
            self.hits[event.request_id] = int(event.detail.split("=", 1)[1])

    def on_step(self, event) -> None:
        plan = event.plan
        pre = sum(s.count for s in plan.slices if s.phase == PREFILL)
        self.steps.append(StepRec(time.perf_counter(), plan.model, pre > 0, plan.rows, pre, self._pending,
                                  event.duration_s))
        self._pending = 0

    # derived ------------------------------------------------------------------------
    def split(self) -> dict:
        """ttft: run start -> end of the last target step with prefill rows; decode: after it."""
        tgt = [s for s in self.steps if s.model == TARGET]
        last_pre = max((i for i, s in enumerate(tgt) if s.prefill), default=-1)
        t_pre = tgt[last_pre].t if last_pre >= 0 else self.t0
        after = tgt[last_pre + 1 :]
        dec_tokens = sum(s.tokens for s in after)
        dec_time = (after[-1].t - t_pre) if after else 0.0
        prev, rates, gaps = t_pre, [], []
        for s in after:  # per-step rates: the median ignores bursts of other processes
            if s.t > prev and s.tokens:
                rates.append(s.tokens / (s.t - prev))
            gaps.append(s.t - prev)
            prev = s.t
        return {
            "decode_rate_median": statistics.median(rates) if rates else None,
            "step_s_median": statistics.median(gaps) if gaps else None,
            "ttft_s": t_pre - self.t0,
            "decode_s": dec_time,
            "decode_tokens": dec_tokens,
            "decode_steps": len(after),
            "prefill_rows": sum(s.prefill_rows for s in tgt),
            "prefill_forward_s": sum(s.duration for s in tgt if s.prefill),
            "total_s": (self.steps[-1].t - self.t0) if self.steps else 0.0,
            "tokens": sum(s.tokens for s in tgt),
        }


def median_rate(stamps: list[tuple[float, int]]):
    """Median over steps of tokens / interval, from (time, tokens) of consecutive steps."""
    r = [n / (t1 - t0) for (t0, _), (t1, n) in zip(stamps, stamps[1:]) if t1 > t0 and n]
    return statistics.median(r) if r else None


def sync():
    mx.synchronize()


def batch_runner(side: str, loaded, prompts: list[list[int]], tokens: int):
    """A function that runs `prompts` for `tokens` new tokens each, all arriving at once, on
    one side and returns its steps: "engine" (native, untraced, concurrent) or "mlxlm"
    (BatchGenerator, the whole batch in one prefill and one decode batch)."""
    from mlx_lm.generate import BatchGenerator

    from divergence.core.request import Request
    from divergence.engine.engine import Engine

    if side == "engine":
        eng = Engine(loaded, policy="native", stop_at_eos=False)

        def run() -> int:
            reqs = [Request(f"r{i}", tuple(p), max_tokens=tokens) for i, p in enumerate(prompts)]
            return eng.run(reqs, "concurrent").steps
        return run

    def run() -> int:
        gen = BatchGenerator(loaded.model, max_tokens=tokens, completion_batch_size=max(32, len(prompts)),
                             prefill_batch_size=max(8, len(prompts)))
        gen.insert([list(p) for p in prompts], [tokens] * len(prompts))
        n = 0
        while gen.next_generated():
            n += 1
        gen.close()
        return n
    return run


def reset_mem():
    sync()
    mx.clear_cache()
    mx.reset_peak_memory()


def peak_mb() -> float:
    return mx.get_peak_memory() / 2**20


# -- stats / output -----------------------------------------------------------------
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summary(xs) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "samples": [round(x, 6) for x in xs]}


def paired_ratio(a: list, b: list):
    """Median over repetitions of a[i] / b[i] (interleaved pairs cancel slow drift)."""
    r = [x / y for x, y in zip(a, b) if x is not None and y]
    return statistics.median(r) if r else None


def fmt(x, nd=2):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = []
    for j, r in enumerate(cells):
        out.append("  ".join(c.ljust(w[i]) if i < 3 else c.rjust(w[i]) for i, c in enumerate(r)))
        if j == 0:
            out.append("  ".join("-" * x for x in w))
    return "\n".join(out)


def meta(args) -> dict:
    import mlx_lm

    from divergence.engine.kernels.blas import blas_in_use

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "divergence"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except Exception:
        commit, dirty = "", None
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": commit,
        "engine_tree_dirty": dirty,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "blas": blas_in_use(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "device": str(mx.default_device()),
        "argv": sys.argv[1:],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def merge_results(path, new: list[dict], key) -> list[dict]:
    """Results of an earlier run at `path` with the entries of `new` replacing those with the same key."""
    try:
        old = json.loads(Path(path).read_text()).get("results", [])
    except (OSError, ValueError):
        old = []
    fresh = {key(r) for r in new}
    kept = [r for r in old if key(r) not in fresh]
    for r in kept:
        r.setdefault("merged_from_earlier_run", True)
    return kept + new


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"[bench] wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def out_path(name: str, quick: bool, out=None) -> Path:
    """Where a bench writes its JSON: --out when given; a full run: bench/results/<name>.json
    (the latest result of each bench); --quick: a temp dir, so a check of the script does not
    replace the recorded measurement."""
    if out:
        return Path(out)
    if quick:
        return Path(tempfile.gettempdir()) / "divergence-bench" / "quick" / f"{name}.json"
    return RESULTS / f"{name}.json"

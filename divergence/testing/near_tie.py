"""A router near-tie that flips on whatever kernels the backend picks, for tests of routing flips.

How close two gate values must be to swap under another kernel depends on that kernel's
rounding, so a tie planted at one fixed scale flips under some BLAS cores and not others.
`planted_router_pair` tries the scales of NEAR_TIE_SCALES in turn and keeps the first at
which some token's experts at the planted layer differ between the serial run (native) and
its replay with every router on split-K gemm; it fails, saying so, if none does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..analysis.force_spec import parse_force
from ..core.request import Request
from ..trace.reader import Trace
from ..workloads.runner import RunConfig, run_schedules
from .models import make_random_model

# router rows = row 0 + eps * noise: from a tie that rarely flips to one a few ulps wide
NEAR_TIE_SCALES = (1e-6, 1e-7, 3e-8)


def routing_flips(a, b, layer: int) -> int:
    """How many (request, position) rows at `layer` route to other experts in b than in a."""
    n = 0
    for r in a.requests:
        ra, rb = a.routing(r.id), b.routing(r.id)
        sa, sb = ra["layer"] == layer, rb["layer"] == layer
        ea, eb = np.sort(ra["experts"][sa], axis=1), np.sort(rb["experts"][sb], axis=1)
        m = min(len(ea), len(eb))
        n += int((ea[:m] != eb[:m]).any(axis=1).sum())
    return n


def planted_router_pair(directory, layer: int, prompts, *, max_tokens: int = 32, arrivals=None, flipped=None,
                        **model_kw) -> tuple[Path, Path]:
    """(serial.h5, gate.h5) in `directory`: a random mixtral (model_kw: make_random_model's
    shape options) with a near-tied router at `layer`, run serially under native, and that
    run replayed with every step's router on gemm:2. flipped(a, b) -> bool: what counts as
    a flip (default: some routing at `layer` differs)."""
    from ..analysis.replayer import Replayer  # (lazy: loads the BLAS)
    from ..engine.model.loading import load_model  # (lazy: loads MLX)

    directory = Path(directory)
    tried = []
    for i, eps in enumerate(NEAR_TIE_SCALES):
        d = directory / f"tie{i}"
        loaded = load_model(make_random_model(d / "m", model_type="mixtral", planted_tie=(layer, eps), **model_kw))
        reqs = [Request(f"r{j}", tuple(loaded.encode(p)), max_tokens=max_tokens,
                        arrival=arrivals[j] if arrivals else 0) for j, p in enumerate(prompts)]
        run_schedules(RunConfig(model=loaded.path), loaded, None, reqs, ["serial"], d)
        with Trace.open(d / "serial.h5") as a:
            forced = parse_force([f"{int(s)}:gate=gemm:2" for s in a.steps["index"]])
            Replayer().replay_to_file(a, d / "gate.h5", forced=forced)
            with Trace.open(d / "gate.h5") as b:
                flips = flipped(a, b) if flipped is not None else routing_flips(a, b, layer)
        if flips:
            return d / "serial.h5", d / "gate.h5"
        tried.append(f"{eps:g}")
    raise AssertionError(f"no planted near-tie at layer {layer} flipped a routing under gemm:2 on this backend "
                         f"(scales tried: {', '.join(tried)})")

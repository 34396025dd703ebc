"""One-way imports: the layout's rooms import only the rooms below them (ROOMS),
reading, diffing, bisecting and browsing traces, and loading the pytest plugin,
import neither MLX nor the engine (which loads a BLAS), and the packages of
divergence import each other without cycles."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import divergence

PKG = Path(divergence.__file__).parent

# modules that must never import divergence.engine (replayer is analysis's one door to it)
ENGINE_FREE = ["core", "trace", "analysis", "tui", "testing/plugin.py", "testing/settings.py", "errors.py", "record",
               "cli/import_cmd.py"]
ENGINE_DOORS = {"analysis/replayer.py"}
ENGINE_ROOMS = ("engine", "parallel", "workloads")  # what loads MLX and a BLAS

# room -> the rooms it may import (a room: a package of divergence, or engine's own
# subpackages); data flows one way: engine -> parallel -> workloads, trace -> record /
# analysis -> tui; cli and testing are thin consumers of everything below them
_BASE = {"core", "errors"}
_ENGINE = {"engine", "engine.sched", "engine.model", "engine.kernels"}
ROOMS = {
    "__main__": {"cli"},
    "errors": set(),
    "core": {"errors"},
    "trace": _BASE,
    "record": _BASE | {"trace"},
    "engine.sched": _BASE,
    "engine.kernels": _BASE | {"__init__"},  # (__init__: the package version, for the environment)
    "engine.model": _BASE | {"engine.kernels", "engine.sched"},
    "engine": _BASE | _ENGINE - {"engine"},
    "parallel": _BASE | {"engine.kernels", "trace"},
    "workloads": _BASE | _ENGINE | {"parallel", "trace", "record"},
    "analysis": _BASE | {"trace", "record"},  # + the replayer's door: ENGINE_DOORS
    "tui": _BASE | {"trace", "analysis"},
    "serve": _BASE | _ENGINE | {"parallel", "trace", "record", "workloads"},
    "testing": _BASE | _ENGINE | {"__init__", "trace", "record", "analysis", "workloads", "fixtures"},
    "cli": None,  # anything
}
DOOR_ROOMS = _ENGINE | {"parallel", "workloads"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every divergence module a file imports, relative imports resolved (lazy ones included)."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    # type-only imports (under `if TYPE_CHECKING:`) run nothing and may point upward
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in out if m == "divergence" or m.startswith("divergence.")}


def _files(entry: str) -> list[Path]:
    p = PKG / entry
    return [p] if p.suffix == ".py" else sorted(p.rglob("*.py"))


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "engine" and (PKG / "engine" / parts[2]).is_dir():
        return f"engine.{parts[2]}"
    if len(parts) < 2 or not ((PKG / parts[1]).is_dir() or (PKG / f"{parts[1]}.py").exists()):
        return "__init__"  # the package itself (divergence.__version__)
    return parts[1]


def test_each_room_imports_only_the_rooms_below_it():
    bad = []
    for f in PKG.rglob("*.py"):
        if "fixtures" in f.parts:
            continue
        rel = str(f.relative_to(PKG))
        src = _room(_module_name(f))
        if src == "__init__" or (src in ROOMS and ROOMS[src] is None):
            continue
        assert src in ROOMS, f"{rel}: room {src} has no entry in ROOMS: say what it may import"
        allowed = ROOMS[src] | {src} | (DOOR_ROOMS if rel in ENGINE_DOORS else set())
        for m in _imports(f):
            dst = _room(m)
            if dst not in allowed:
                bad.append(f"{rel} ({src}) imports {m} ({dst})")
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_loose_top_level_modules():
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py", "errors.py"))
    assert not loose, f"modules outside a room: {loose}"


def test_engine_free_layers_never_import_the_engine():
    bad = []
    for entry in ENGINE_FREE:
        for f in _files(entry):
            rel = str(f.relative_to(PKG))
            if rel in ENGINE_DOORS:
                continue
            for m in _imports(f):
                if _room(m).split(".")[0] in ENGINE_ROOMS:
                    bad.append(f"{rel} imports {m}")
    assert not bad, "\n".join(bad)


def test_core_imports_only_numpy_xxhash_and_the_stdlib():
    allowed_third_party = {"numpy", "xxhash"}
    bad = []
    for f in _files("core"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for n in names:
                top = n.split(".")[0]
                if top in ("divergence",):
                    if not (n.startswith("divergence.core") or n == "divergence.errors"):
                        bad.append(f"{f.name}: {n}")
                elif top not in allowed_third_party and top not in sys.stdlib_module_names:
                    bad.append(f"{f.name}: {n}")
        for m in _imports(f):
            if not (m.startswith("divergence.core") or m.startswith("divergence.errors")):
                bad.append(f"{f.name}: {m}")
    assert not bad, "\n".join(bad)


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycles_between_packages():
    """Subpackages (core, engine, parallel, workloads, trace, record, analysis, tui, testing,
    cli) form a graph without cycles; an edge A -> B means some module of A imports B."""
    graph: dict[str, set[str]] = {}
    for f in PKG.rglob("*.py"):
        if "fixtures" in f.parts:
            continue
        src = _package_of(_module_name(f))
        for m in _imports(f):
            dst = _package_of(m)
            if dst and dst != src and ((PKG / dst).is_dir() or (PKG / f"{dst}.py").exists()):
                graph.setdefault(src, set()).add(dst)
    seen, stack, cycles = set(), [], []

    def visit(n):
        if n in stack:
            cycles.append(stack[stack.index(n):] + [n])
            return
        if n in seen:
            return
        seen.add(n)
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            visit(d)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    assert not cycles, "import cycles between packages: " + "; ".join(" -> ".join(c) for c in cycles)


def test_reading_diffing_bisecting_the_html_page_and_the_plugin_load_neither_mlx_nor_a_blas(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    # write the pair in this process (it may import anything), read it in a clean one
    sys.path.insert(0, str(Path(__file__).parents[1] / "trace"))
    try:
        import numpy as np
        from synthetic import emit_run
        from divergence.trace.writer import TraceWriter
        for path, seed in ((a, 0), (b, 1)):
            with TraceWriter(path, top_k=4) as w:
                emit_run(w, rng=np.random.default_rng(seed))
    finally:
        sys.path.pop(0)
    code = textwrap.dedent(f"""
        import sys
        import divergence
        from divergence.analysis.bisect import bisect_traces
        from divergence.analysis.diff import diff_traces
        from divergence.analysis.report import render_bisect
        from divergence.analysis.html import render_html
        import divergence.testing.plugin
        import divergence.tui.app
        with divergence.Trace.open({str(a)!r}) as ta, divergence.Trace.open({str(b)!r}) as tb:
            rep = bisect_traces(ta, tb)
            render_bisect(rep)
            render_html(rep, ta, tb)
            assert not rep.diff.identical
        mods = sorted(m for m in sys.modules if m == "mlx" or m.startswith("mlx.") or m.startswith("mlx_lm")
                      or m.split(".")[1:2] in (["engine"], ["parallel"], ["workloads"]))
        maps = open("/proc/self/maps").read().lower()
        blas = sorted({{line.split()[-1] for line in maps.splitlines() if "blas" in line or "libmlx" in line}})
        print("MODS", mods)
        print("BLAS", blas)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MODS []" in out.stdout, out.stdout
    blas = [line for line in out.stdout.splitlines() if line.startswith("BLAS")][0]
    # numpy's own bundled OpenBLAS (numpy.libs) is numpy's business; no other BLAS may be mapped
    libs = eval(blas[5:])
    assert all("numpy" in lib for lib in libs), libs


def test_top_level_names_are_lazy_and_public():
    code = ("import sys, divergence; assert 'mlx' not in sys.modules; "
            "from divergence import Trace, Request; assert 'mlx' not in sys.modules; "
            "from divergence import Engine, load_model; assert 'mlx' in sys.modules; "
            "print(Engine.__module__, load_model.__module__, Request.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["divergence.engine.engine", "divergence.engine.model.loading", "divergence.core.request"]


def test_name_tables_have_one_source():
    """No module but core/names.py spells out a name table (phases, models, ops,
    kernels, schedules, request events) as a literal: a second copy could drift."""
    from divergence.core import names

    tables = {tuple(v) for k, v in vars(names).items() if isinstance(v, tuple) and len(v) > 1}
    subsets = {frozenset(t) for t in tables}
    bad = []
    for f in PKG.rglob("*.py"):
        if f == PKG / "core" / "names.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and \
                    all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                vals = frozenset(e.value for e in node.elts)
                if any(vals >= t and len(t) > 1 for t in subsets):
                    bad.append(f"{f.relative_to(PKG)}:{node.lineno}: {sorted(vals)}")
    assert not bad, "name tables copied outside core/names.py:\n" + "\n".join(bad)
    from divergence.trace import schema
    assert (schema.PHASES, schema.MODELS, schema.OPS, schema.KERNELS) == \
           (names.PHASES, names.MODELS, names.OPS, names.KERNELS)


def test_tensor_parallelism_lives_in_one_package():
    """Only divergence/parallel/ names the collectives and the TP environment: the engine
    is handed a group object, the CLI asks parallel/ what a command needs."""
    words = ("all_reduce", "all_sum", "all_gather", "mx.distributed", "MLX_RANK", "MLX_HOSTFILE", "NCCL_HOST_IP",
             "NCCL_PORT", "MLX_WORLD_SIZE", "DIVERGENCE_TP_")
    bad = [f"{f.relative_to(PKG)}: {w}" for f in PKG.rglob("*.py") if "parallel" not in f.relative_to(PKG).parts
           for w in words if w in f.read_text()]
    assert not bad, "\n".join(bad)


def test_modules_outside_the_engine_load_the_blas_before_mlx():
    """MLX resolves its BLAS when it is first imported: a module outside divergence/engine/
    (whose __init__ loads it) that imports mlx at its top must load the BLAS first."""
    bad = []
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG)
        if rel.parts[0] == "engine" or "fixtures" in rel.parts:
            continue
        blas_seen = False
        for node in ast.parse(f.read_text()).body:  # module level only: lazy imports follow an engine import
            if isinstance(node, ast.ImportFrom) and node.module and "kernels" in node.module and \
                    any(a.name == "blas" for a in node.names):
                blas_seen = True
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n.split(".")[0] in ("mlx", "mlx_lm") for n in names) and not blas_seen:
                bad.append(f"{rel}:{node.lineno}")
                break
    assert not bad, "mlx imported before the BLAS is loaded: " + ", ".join(bad)

"""Facts of this host that more than one layer reads (stdlib only)."""
from __future__ import annotations

import os

# How many parts the engine splits a CPU product into (engine/kernels/splits.py): 1 turns the
# split off; the tensor-parallel launcher gives each rank its share of the cores.
CPU_SPLIT_ENV = "DIVERGENCE_CPU_SPLIT"

# Which BLAS the engine loads before MLX (divergence/engine/kernels/blas.py): "reference" keeps MLX's bundled
# one, a path names a libblas; and which core OpenBLAS (DYNAMIC_ARCH) runs, else its pick for
# this CPU. Both are read when the library loads: a process cannot switch them later.
BLAS_ENV = "DIVERGENCE_BLAS"
CORE_ENV = "OPENBLAS_CORETYPE"
REFERENCE_WORDS = ("reference", "off", "0", "none")


def is_reference(blas: str | None) -> bool:
    """Does a recorded `blas` string (environment()["blas"]) name MLX's bundled reference BLAS?"""
    return str(blas or "").startswith("reference")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# OpenBLAS cores (OPENBLAS_CORETYPE names) and the CPU flags each one's kernels need; the
# ones CI forces in turn are the x86 kernel families that round fp32 products differently.
# Prescott (SSE3) is last: every x86-64 CPU runs it and OpenBLAS picks it where it knows no
# better (an unknown CPU, a VM's masked flags), and an AVX-512 CI machine never would on its own.
CORE_FLAGS = {
    "Prescott": frozenset({"sse3"}),
    "Sandybridge": frozenset({"avx"}),
    "Haswell": frozenset({"avx2", "fma"}),
    "Zen": frozenset({"avx2", "fma"}),
    "SkylakeX": frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    "Cooperlake": frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"}),
}
CHECKED_CORES = ("Haswell", "Zen", "SkylakeX", "Cooperlake", "Prescott")


def cpu_flags() -> frozenset:
    """The flags of this CPU (/proc/cpuinfo's `flags` line, with sse3 as `pni`); empty
    where the OS has no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    if "pni" in flags:
                        flags.add("sse3")
                    return frozenset(flags)
    except OSError:
        pass
    return frozenset()


def missing_flags(core: str, flags: frozenset | None = None) -> frozenset | None:
    """The CPU flags core `core` needs that this CPU lacks (empty: it can run it); None
    for a core this table does not know."""
    need = next((v for k, v in CORE_FLAGS.items() if k.lower() == str(core).lower()), None)
    if need is None:
        return None
    return need - (cpu_flags() if flags is None else flags)


def runnable_cores(cores=CHECKED_CORES) -> list[str]:
    """Of `cores`, those this CPU can run."""
    flags = cpu_flags()
    return [c for c in cores if missing_flags(c, flags) == frozenset()]

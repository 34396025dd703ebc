"""Facts of this host that more than one layer reads (stdlib only)."""
from __future__ import annotations

import os

# How many parts the engine splits a CPU product into (engine/cpu_split.py): 1 turns the
# split off; the tensor-parallel launcher gives each rank its share of the cores.
CPU_SPLIT_ENV = "DIVERGENCE_CPU_SPLIT"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

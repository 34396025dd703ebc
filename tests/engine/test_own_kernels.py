"""A stand-in kernel is never taken for the backend's own, whenever the module that stores
probe results on disk is first imported (it once captured 'own' at its import, so a test's
swapped attention kernel wrote its signature into the user's cache)."""
from __future__ import annotations

import subprocess
import sys


def test_a_kernel_swapped_before_the_first_import_is_not_the_own():
    code = (
        "from divergence.engine.kernels import attention, linear\n"
        "attention.run_batched = lambda *a: None\n"
        "from divergence.engine.kernels import native_classes\n"
        "assert not native_classes._own_kernels(), 'a stand-in attention passed for the own kernel'\n"
        "attention.run_batched = attention.OWN_KERNELS[1]\n"
        "assert native_classes._own_kernels()\n"
        "linear.run_native = lambda x, op: x\n"
        "assert not native_classes._own_kernels(), 'a stand-in linear kernel passed for the own'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

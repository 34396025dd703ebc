"""What a replay is asked to force, as `--force STEP:KERNEL` words: parsed, checked against
a trace (a forcing that would silently do nothing is refused) and described. Engine-free."""
from __future__ import annotations

import numpy as np

from ..core.names import ATTENTION, ATTENTION_KERNELS, OPS, TP_SHARDING
from ..core.policy import SOLO, SOLO_NAME, UNSHARDED, UNSHARDED_NAME, KernelPolicy, UnshardedStep
from ..errors import PolicyError


def parse_force(items) -> dict:
    """['7:gemv', '12:gemm:4', '9:lm_head=gemv', '8:solo'] -> {step: policy, {op: policy}, or SOLO}.
    Checks the syntax, the op names and the kernels; `check_forced` checks them against a trace."""
    out: dict = {}
    for item in items or ():
        step, sep, spec = str(item).partition(":")
        if not sep or not step.strip().isdigit():
            raise PolicyError(f"bad --force {item!r}: expected STEP:KERNEL or STEP:OP=KERNEL, e.g. 7:gemv")
        op, eq, kernel = spec.partition("=")
        if not eq:
            word = spec.strip().lower()
            if int(step) in out:
                raise PolicyError(f"bad --force {item!r}: step {int(step)} is already forced; force a step once "
                                  f"(one op at a time with STEP:OP=KERNEL)")
            out[int(step)] = SOLO if word == SOLO_NAME else UNSHARDED if word == UNSHARDED_NAME else _parse_kernel(item, spec)
            continue
        if op not in OPS:
            raise PolicyError(f"bad --force {item!r}: unknown op {op!r} (ops: {', '.join(OPS)})")
        per_op = out.setdefault(int(step), {})
        if not isinstance(per_op, dict):
            raise PolicyError(f"bad --force {item!r}: step {step} is already forced as a whole")
        if kernel.strip().lower() == SOLO_NAME:
            raise PolicyError(f"bad --force {item!r}: solo applies to a whole step (STEP:solo), not to one op")
        if op in per_op:
            raise PolicyError(f"bad --force {item!r}: op {op} of step {step} is already forced; force it once")
        if kernel.strip().lower() == UNSHARDED_NAME:
            per_op[op] = UNSHARDED
            continue
        pol = _parse_kernel(item, kernel)
        if (op == ATTENTION) != (pol.name in ATTENTION_KERNELS):
            raise PolicyError(f"bad --force {item!r}: attention takes {' or '.join(ATTENTION_KERNELS)}, "
                              f"the other ops linear kernels")
        per_op[op] = pol
    return out


def _parse_kernel(item, text):
    try:
        return KernelPolicy.parse(text)
    except PolicyError as e:
        raise PolicyError(f"bad --force {item!r}: {e}") from None


def check_forced(trace, forced: dict) -> None:
    """Refuse forcing that would silently do nothing: a step the trace does not have, or
    an op the trace's model never ran (e.g. lm_head=... on a draft step). PolicyError, one line."""
    if not forced:
        return
    steps = np.asarray(trace.steps["index"])
    have = set(int(x) for x in steps)
    span = f"steps {int(steps.min())}-{int(steps.max())}" if len(steps) else "no steps"
    check_unsharded(trace, forced)
    for step, pol in sorted(forced.items()):
        if step not in have:
            raise PolicyError(f"--force {step}:{describe_forced({step: pol})[step]}: {trace.path} has no step "
                              f"{step} ({span})")
        if isinstance(pol, dict):
            ran = set(str(o) for o in trace.kernels(step=step)["op"])
            unknown = sorted(set(pol) - ran) if ran else []
            if unknown:
                raise PolicyError(f"--force {step}:{unknown[0]}=...: step {step} of {trace.path} ran no op "
                                  f"{unknown[0]!r} (it ran {', '.join(o for o in _op_order(ran))})")


def check_unsharded(trace, forced: dict) -> None:
    """STEP:unsharded on a trace of one device would silently do nothing: refuse it."""
    uses = any(isinstance(p, UnshardedStep) or (isinstance(p, dict) and any(isinstance(x, UnshardedStep)
               for x in p.values())) for p in forced.values())
    if uses and trace.tp_degree <= 1:
        raise PolicyError(f"--force ...:unsharded: {trace.path} was recorded on one device (TP=1): nothing is sharded")
    for step, p in forced.items():
        if isinstance(p, dict):
            bad = [op for op, x in p.items() if isinstance(x, UnshardedStep) and op not in TP_SHARDING]
            if bad:
                raise PolicyError(f"--force {step}:{bad[0]}=unsharded: {bad[0]} is not sharded "
                                  f"(sharded ops: {', '.join(TP_SHARDING)})")


def _op_order(ops) -> list[str]:
    return [o for o in OPS if o in ops] + sorted(o for o in ops if o not in OPS)


def describe_forced(forced: dict) -> dict[int, str]:
    return {step: (", ".join(f"{op}={p}" for op, p in pol.items()) if isinstance(pol, dict) else str(pol))
            for step, pol in forced.items()}


def force_args(forced: dict) -> list[str]:
    """The `--force` arguments that parse_force reads back as `forced` (a child's replay)."""
    out = []
    for step, pol in sorted(forced.items()):
        for spec in ([f"{op}={p}" for op, p in pol.items()] if isinstance(pol, dict) else [str(pol)]):
            out += ["--force", f"{step}:{spec}"]
    return out

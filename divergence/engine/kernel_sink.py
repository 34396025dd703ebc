"""Where a step's kernel choices collect while its graph is built (run.py's Run holds one)."""
from __future__ import annotations

from ..core.events import KERNEL_ROW, AllReduce, KernelChoice, kernel_choice


class KernelSink:
    """Where the dispatchers' kernel events go while a step's graph is built: the step's rows
    (StepKernels.rows), or nowhere between steps. A kernel choice of the step goes in as a
    row (its fields but step: `row`, the dispatcher's; a KernelChoice, the experts', turned
    into one); anything else (an all-reduce, a choice of another step) as the event, and the
    step is `mixed`. Its own object, not a method of the Run: the Run holds its model states,
    whose dispatchers hold this, so a bound method would make every traced Run cyclic
    garbage, freed (its KV cache with it) only by a full collection, a pause as long as a
    short run."""

    __slots__ = ("buf", "step", "mixed")

    def __init__(self):
        self.buf: list | None = None
        self.step = -1
        self.mixed = False

    def row(self, step: int, row: tuple) -> None:
        buf = self.buf
        if buf is not None:
            if step == self.step:
                buf.append(row)
            else:
                buf.append(kernel_choice(step, row))
                self.mixed = True

    def __call__(self, event: KernelChoice | AllReduce) -> None:
        buf = self.buf
        if buf is None:
            return
        if type(event) is KernelChoice and event.step == self.step:
            d = event.__dict__
            buf.append(tuple([d[f] for f in KERNEL_ROW]))
        else:
            buf.append(event)
            self.mixed = True

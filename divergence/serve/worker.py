"""The engine side of a live server: live runs, one trace segment each, back to back.

The HTTP event loop (on another thread) never runs a step: it submits to the inbox and
reads results that the engine hands over through each request's sink. A segment ends when
it is due to rotate (size or age, once drained) or on stop; the requests waiting then start
the next. `divergence serve` runs the engine on the main thread (`run`): MLX aborts the
process at exit after another thread ran its streams; `start` runs it on a thread of its own.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from ..trace.writer import TraceWriter
from .live import Deliver, Inbox, LiveRequest, LiveRun
from .private import TRACE_MODE, make_dir

log = logging.getLogger("divergence.serve")


class EngineWorker:
    def __init__(self, engine, trace_dir, *, rotate_bytes: int | None = None, rotate_seconds: float | None = None,
                 kv_hashes: bool = True, on_segment=lambda path: None, spec_control=None):
        self.engine = engine
        self.trace_dir = Path(trace_dir)
        self.rotate_bytes = rotate_bytes
        self.rotate_seconds = rotate_seconds
        self.kv_hashes = kv_hashes
        self.on_segment = on_segment  # called with each new trace's path, once it exists
        self.spec_control = spec_control  # the draft length's controller, across segments (or None: spec_k)
        self.inbox = Inbox()
        self.traces: list[Path] = []  # every segment written, in order
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._deliver: Deliver | None = None
        self._segment = 0

    @property
    def current_trace(self) -> Path | None:
        return self.traces[-1] if self.traces else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="divergence-engine", daemon=True)
        self._thread.start()
        self._ready.wait()  # the first segment's trace exists: the server can name it
        if self.error is not None:
            raise self.error

    def submit(self, req: LiveRequest) -> Path:
        """Queue a request; returns the trace it will be recorded in (the segment now open, or
        the next one where this one is rotating: then the response names the one it ran in)."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error!r}")
        self.inbox.submit(req)
        return self.current_trace

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self.inbox.cancel(request_id, reason)

    def stop(self, timeout: float | None = None) -> None:
        """Drain: the requests taken finish, the trace closes complete."""
        self.inbox.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine's thread ----------------------------------------------------------------------
    def run(self) -> None:
        """Serve segments until stop() (from another thread or a signal handler) and drained.
        An engine failure fails the requests in flight, refuses new ones (503), and is raised."""
        try:
            make_dir(self.trace_dir)
            while True:
                self._run_segment()
                if self.inbox.stopping and not self.inbox.pending():
                    break
        except BaseException as e:  # noqa: BLE001  (the HTTP side answers 500 from here on)
            log.exception("the engine thread failed")
            self.error = e
            for sink in list((self._deliver.sinks if self._deliver else {}).values()):
                sink.done("error")
            if self._thread is None:
                raise
        finally:
            self._ready.set()

    def _run_segment(self) -> None:
        path = self._next_path()
        rotate = self._rotation(path)
        e = self.engine
        writer = TraceWriter(path, top_k=e.top_k, kv_hashes=self.kv_hashes, mode=TRACE_MODE)
        deliver = Deliver()
        e.observers = [writer, deliver]  # before the run: it asks them what to record (KV hashes, kernels, ...)
        run = LiveRun(e, self.inbox, deliver, writer=writer, rotate=rotate, on_ready=lambda: self._segment_ready(path),
                      spec_control=self.spec_control)
        self._deliver = deliver
        try:
            with writer:
                run.execute()
        finally:
            e.observers = []
        log.info("trace %s closed (%d requests)", path, run.taken)

    def _rotation(self, path: Path):
        """rotate() for a segment starting now: is it due (its age, the file's size)?"""
        started = time.monotonic()

        def rotate() -> bool:
            if self.rotate_seconds and time.monotonic() - started >= self.rotate_seconds:
                return True
            try:
                return bool(self.rotate_bytes) and path.stat().st_size >= self.rotate_bytes
            except OSError:
                return False
        return rotate

    def _segment_ready(self, path: Path) -> None:
        """The segment's trace exists: the server can name it."""
        self.traces.append(path)
        self._ready.set()
        self.on_segment(path)

    def _next_path(self) -> Path:
        self._segment += 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.trace_dir / f"live-{stamp}-{self._segment:03d}.h5"
        if path.exists():  # another server on this directory in the same second
            path = path.with_name(f"live-{stamp}-{os.getpid()}-{self._segment:03d}.h5")
        return path

"""A run that takes requests while it runs: the engine's own step loop (engine/run.py), fed
between steps from an inbox that HTTP handlers fill on other threads.

Everything that changes engine state happens on the engine thread, in `LiveRun.more_work`
(the loop's hook between steps), through the Run's hooks: new requests join (`admit`) with
arrival = the loop's clock when they came in, cancelled ones leave (`cancel`: their blocks
freed), delivered ones are forgotten (`forget`). So a live
trace is a `concurrent` run's trace like any other: same steps, same events, same tables,
plus /live_requests for the requests that arrived after it started.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from ..core.events import Observer, RequestEvent, TokenEvent
from ..core.names import CONCURRENT
from ..core.request import Request, Sampling
from ..engine.run import Run

CANCELLED, STOP = "cancelled", "stop"


class Sink:
    """Where a request's results go (serve.app hands them to the event loop). Called on the
    engine thread; must not block."""

    def joined(self, trace_path) -> None:
        """The engine took the request; it is recorded in this trace."""

    def token(self, event: TokenEvent) -> None: ...
    def done(self, reason: str) -> None: ...


@dataclass
class LiveRequest:
    """A request as the HTTP layer validated it, waiting for the engine to take it."""

    id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    sink: Sink = field(default_factory=Sink)
    prompt_text: str | None = None


class Inbox:
    """Submissions and cancellations from any thread; the engine thread takes them between steps."""

    def __init__(self):
        self._cv = threading.Condition()
        self._submitted: deque[LiveRequest] = deque()
        self._cancelled: dict[str, str] = {}  # request id -> reason
        self.stopping = False

    def submit(self, req: LiveRequest) -> None:
        with self._cv:
            if self.stopping:
                raise RuntimeError("the server is shutting down")
            self._submitted.append(req)
            self._cv.notify_all()

    def cancel(self, request_id: str, reason: str = CANCELLED) -> None:
        with self._cv:
            self._cancelled.setdefault(request_id, reason)
            self._cv.notify_all()

    def stop(self) -> None:
        """Take nothing new; the running requests finish (drain)."""
        with self._cv:
            self.stopping = True
            self._cv.notify_all()

    def take(self, *, submissions: bool) -> tuple[list[LiveRequest], dict[str, str]]:
        """Everything waiting: (submissions, or none when not taking them now; cancellations).
        A cancellation of a request still waiting here removes it and is returned too."""
        with self._cv:
            cancels, self._cancelled = self._cancelled, {}
            kept = deque()
            for r in self._submitted:
                if r.id in cancels:
                    r.sink.done(cancels.pop(r.id))  # never joined a run: nothing to record
                else:
                    kept.append(r)
            self._submitted = kept
            subs = list(kept) if submissions else []
            if submissions:
                self._submitted = deque()
            return subs, cancels

    def pending(self) -> bool:
        with self._cv:
            return bool(self._submitted or self._cancelled)

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not (self._submitted or self._cancelled or self.stopping):
                self._cv.wait(timeout)


class Deliver(Observer):
    """Hands each request's tokens to its sink as they commit; finishes wait for the trace
    flush (LiveRun.deliver_finished), so a client that has its whole answer finds its request
    on disk, even if the server is killed right after."""

    def __init__(self):
        self.sinks: dict[str, Sink] = {}
        self.finished: list[tuple[str, str]] = []

    def on_token(self, event: TokenEvent) -> None:
        sink = self.sinks.get(event.request_id)
        if sink is not None:
            sink.token(event)

    def on_request(self, event: RequestEvent) -> None:
        if event.kind in ("finished", CANCELLED) and event.request_id in self.sinks:
            self.finished.append((event.request_id, event.detail or event.kind))


class LiveRun(Run):
    """One trace segment of a live server: runs until told to stop (or rotate) and drained.

    writer: the TraceWriter among the engine's observers (flushed when idle and before a
    finish is delivered); rotate(): whether this segment should end once drained (the
    requests waiting meanwhile start the next one)."""

    IDLE_POLL_S = 0.25

    def __init__(self, engine, inbox: Inbox, deliver: Deliver, *, writer=None, rotate=lambda: False,
                 on_ready=lambda: None, spec_control=None):
        super().__init__(engine, [], CONCURRENT, spec_control=spec_control)
        self.on_ready = on_ready  # called once the trace file exists (the first pass through more_work)
        self.inbox = inbox
        self.deliver = deliver
        self.writer = writer
        self.rotate = rotate
        self.taken = 0  # requests this segment took

    # -- the step loop's hook ---------------------------------------------------------------
    def more_work(self, sched, clock: int) -> bool:
        if self.on_ready is not None:
            if self.writer is not None:
                self.writer.flush()
            self.on_ready, ready = None, self.on_ready
            ready()
        while True:
            self.deliver_finished(sched)
            rotating = self.rotate() and self.taken > 0
            subs, cancels = self.inbox.take(submissions=not rotating)  # (what came before a stop is served)
            for rid, reason in cancels.items():
                # a stop string is a finish (the client got its answer), a disconnect a cancellation
                self.cancel(sched, rid, reason=reason, kind="finished" if reason == STOP else CANCELLED)
            for req in subs:
                self._add(sched, clock, req)
            if not sched.done():
                return True
            self.deliver_finished(sched)
            if rotating or self.inbox.stopping:
                return False
            if self.writer is not None:
                self.writer.flush()  # idle: everything so far on disk
            self.inbox.wait(self.IDLE_POLL_S)

    def _add(self, sched, clock: int, lr: LiveRequest) -> None:
        req = Request(lr.id, tuple(lr.prompt_tokens), max_tokens=lr.max_tokens, arrival=clock,
                      sampling=lr.sampling, prompt_text=lr.prompt_text)
        self.deliver.sinks[req.id] = lr.sink
        self.admit(sched, req)
        self.taken += 1
        lr.sink.joined(self.writer.path if self.writer is not None else None)

    def deliver_finished(self, sched) -> None:
        if not self.deliver.finished:
            return
        if self.writer is not None:
            self.writer.flush()
        done, self.deliver.finished = self.deliver.finished, []
        for rid, reason in done:
            sink = self.deliver.sinks.pop(rid, None)
            self.forget(sched, rid)
            if sink is not None:
                sink.done(reason)

    def info(self):
        info = super().info()
        serve = {"started": time.time()}
        if self.e.draft is not None:  # up to spec_k draft tokens a round (adaptive), or always spec_k
            serve["spec"] = "adaptive" if self.spec_control is not None else "fixed"
        return replace(info, settings={**info.settings, "serve": serve})

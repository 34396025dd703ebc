"""Run requests under several schedules with tracing: the API behind `divergence run`,
the pytest plugin and sweeps."""
from __future__ import annotations

import fcntl
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.events import Observer
from ..core.settings import DEFAULT_TOKEN_BUDGET, DEFAULT_TOP_K, EngineSettings
from ..errors import DivergenceInputError, PromptError, TraceError
from ..trace.writer import TraceWriter


@dataclass
class RunConfig:
    model: object  # model directory
    draft: object | None = None
    dtype: str | None = None
    policy: str = "native"
    spec_k: int = 0
    token_budget: int = DEFAULT_TOKEN_BUDGET
    top_k: int = DEFAULT_TOP_K
    prefix_caching: bool = False
    kv_hashes: bool = True
    stop_at_eos: bool = True
    tp: int = 1  # tensor-parallel degree: > 1 runs inside this process's group (divergence.parallel)
    prefill: str = "whole"  # where the prompt's last token is computed (engine.sched.scheduler.PREFILL_LAYOUTS)

    def settings(self) -> dict:
        """The engine settings, as a trace records them (Engine.from_settings reads them)."""
        return EngineSettings(policy=self.policy, token_budget=self.token_budget, spec_k=self.spec_k,
                              top_k=self.top_k, prefix_caching=self.prefix_caching, stop_at_eos=self.stop_at_eos,
                              prefill=self.prefill, dtype=self.dtype).to_dict()


def load_models(cfg: RunConfig):
    """(target, draft or None), from the engine's one per-process model cache."""
    from ..engine.model.loading import load_cached  # (lazy: loads MLX)

    target = load_cached(cfg.model, dtype=cfg.dtype)
    draft = load_cached(cfg.draft, dtype=cfg.dtype) if cfg.draft and cfg.spec_k else None
    return target, draft


def make_engine(cfg: RunConfig, observers=()):
    """The engine of a run config: Engine.from_settings, models from the shared cache."""
    from ..engine.engine import Engine  # (lazy: loads MLX)

    return Engine.from_settings(cfg.settings(), model_dir=cfg.model, draft_dir=cfg.draft if cfg.spec_k else None,
                                observers=observers, tp=_tp_group(cfg))


def _tp_group(cfg: RunConfig):
    if cfg.tp <= 1:
        return None
    from ..parallel.group import current  # (lazy: loads MLX)

    return current()  # joined by the CLI (parallel/ranks.py) before the command ran


class _Progress(Observer):
    """A progress bar over generated tokens, on stderr."""

    def __init__(self, label: str, total: int):
        # (lazy: loads rich, only for a progress bar)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description:<11}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tokens"), TimeElapsedColumn(),
                                 console=Console(file=sys.stderr), transient=True)
        self.task = self.progress.add_task(label, total=total)

    def on_run_start(self, info) -> None:
        self.progress.start()

    def on_token(self, event) -> None:
        self.progress.advance(self.task)

    def on_run_end(self, completed: bool) -> None:
        self.progress.stop()


def _on_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def validate(engine, requests, *, top_k_name: str = "--top-k") -> None:
    """Refuse bad requests (token ids, context length) before anything is written; top_k_name:
    what the caller calls the engine's top-k (a flag, an argument) in the message."""
    vocab = getattr(engine, "vocab", None)
    if vocab and engine.top_k > vocab:
        raise PromptError(f"{top_k_name} {engine.top_k} is larger than the model's vocabulary ({vocab} tokens)")
    for r in requests:
        msg = engine.check(r)
        if msg:
            raise PromptError(msg)


def run_schedules(cfg: RunConfig, target, draft, requests, schedules, out_dir, *, progress: bool = False,
                  engine=None):
    """Run `requests` under each schedule, writing out_dir/<schedule>.h5. Returns {schedule: RunResult}.
    engine: the command's engine, made and its requests validated already (one validation a
    command); None: made and validated here."""
    if engine is None:
        engine = make_engine(cfg)
        validate(engine, requests)

    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DivergenceInputError(f"cannot create --out {out_dir}: {e.strerror or e}") from None
    results = {}
    if engine.tp is not None and not engine.tp.writes:  # tensor parallel: only rank 0 writes
        from ..parallel.group import Mirror  # (lazy: loads MLX)

        for schedule in schedules:
            engine.observers = [Mirror(cfg.kv_hashes)]
            results[schedule] = engine.run(requests, schedule)
        engine.observers = []
        return results
    lock = _lock(out_dir)  # a second run on this --out is refused, not interleaved
    try:
        for schedule in schedules:
            path = out_dir / f"{schedule}.h5"
            tmp = partial_name(path)  # unique per process: two runs never write one file
            try:
                with TraceWriter(tmp, top_k=cfg.top_k, kv_hashes=cfg.kv_hashes) as writer:
                    obs = [writer]
                    if progress and _on_tty():  # a pipe or a log gets no bar (no blank lines, no \r)
                        obs.append(_Progress(schedule, sum(r.max_tokens for r in requests)))
                    engine.observers = obs
                    results[schedule] = engine.run(requests, schedule)
            except TraceError:  # the trace could not be written (a full disk): nothing worth keeping
                tmp.unlink(missing_ok=True)
                raise
            tmp.replace(path)  # an existing trace is only replaced by a complete one
    finally:
        engine.observers = []
        _unlock(lock)
    return results


LOCK_NAME = ".divergence-run.lock"


def partial_name(path: Path) -> Path:
    """Where a run writes `<schedule>.h5` until it is complete: `<schedule>.<pid>-<random>.h5.partial`
    (unique per process; a failed run's partial traces are `*.h5.partial`)."""
    return path.with_name(f"{path.stem}.{os.getpid()}-{secrets.token_hex(4)}{path.suffix}.partial")


def _lock(out_dir: Path):
    """Hold out_dir/.divergence-run.lock (flock, released when the process ends however it ends);
    a directory another run holds is refused with one line."""
    path = out_dir / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise DivergenceInputError(f"--out {out_dir}: cannot create {path.name} ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode("ascii", "replace").strip()
            os.close(fd)
            raise DivergenceInputError(f"--out {out_dir} is in use by another divergence run"
                                       f"{f' (pid {pid})' if pid else ''}; wait for it to end or name another "
                                       f"--out") from None
        except OSError as e:  # a filesystem without locks
            os.close(fd)
            raise DivergenceInputError(f"--out {out_dir}: cannot lock {path.name} ({e.strerror or e})") from None
        try:  # the holder before us may have removed the file we opened: lock the one at the path
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, path


def _unlock(lock) -> None:
    fd, path = lock
    try:
        path.unlink(missing_ok=True)  # while still held: the next run creates and locks a new one
    except OSError:
        pass
    os.close(fd)

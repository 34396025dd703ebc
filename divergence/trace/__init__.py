"""Traces: one HDF5 file per run (docs/trace-format.md).

`Trace` reads, `TraceWriter` writes (an engine Observer), `hash_rows` hashes KV
bytes. Only this package imports h5py; importing it imports neither mlx nor h5py
until a name is used.
"""
from __future__ import annotations

__all__ = ["Trace", "TraceWriter", "TraceRequest", "TokenRecords", "hash_rows"]


def __getattr__(name):
    if name in ("Trace", "TraceRequest", "TokenRecords"):
        from . import reader

        return getattr(reader, name)
    if name == "TraceWriter":
        from .writer import TraceWriter

        return TraceWriter
    if name == "hash_rows":
        from .hashing import hash_rows

        return hash_rows
    raise AttributeError(name)

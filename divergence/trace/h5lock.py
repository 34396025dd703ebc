"""One lock around every HDF5 call of the trace package (writer thread and readers).

h5py serialises its own calls, but a dataset refresh (H5Drefresh, SWMR reads) evicts
cached metadata that another handle in the process may be using, and HDF5 files
opened twice in one process share that cache. Holding this lock for a whole table
read or flush keeps one thread's refresh away from another's reads. Rule: code
holding it calls h5py and numpy only, never waits for another thread.
"""
from __future__ import annotations

import threading

H5_LOCK = threading.RLock()

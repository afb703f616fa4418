"""The server keeps the memory it frees for its next records: glibc's malloc thresholds (docs/design.md §6.3).

Each record the server checks allocates and frees tensors of the same sizes as the record before it: the bench's
float64 copies and outputs in the replay worker, the outputs copied back, the metrics' temporaries. glibc hands
memory above its trim threshold back to the kernel when it is freed, and serves a request above its mmap threshold
with a mapping of its own, unmapped when freed; both adapt as the process runs, but only up to 32 MiB and 64 MiB.
The next record's tensors then take new pages, a page fault and a zeroed page for every 4 KiB, and on a virtual
machine that returns freed memory to its host the fault costs 10-25 us instead of 1.6 us (bench/first_touch.py).

`keep_freed_memory()` fixes both thresholds where glibc's adaptation ends: requests up to 32 MiB come from the
heap, and up to 1 GiB of freed memory at its top stays with the process, as the memory budget allows for anyway
(on bench/server.py's mid transformer: the same peak resident memory, 40 % fewer page faults). Called by gpu-server
and by each replay worker at start. It leaves alone a process whose malloc the user tuned (`GLIBC_TUNABLES` naming
glibc.malloc, or a `MALLOC_*_` variable), and does nothing with `GPU_SERVER_KEEP_FREED_MEMORY=0` or where the C
library is not glibc.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Callable

MMAP_THRESHOLD = 32 << 20   # glibc's ceiling for its own adaptive threshold (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30
WORKER_ARENAS = 2          # a replay worker's malloc arenas (MALLOC_ARENA_MAX): its threads share two heaps
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8   # malloc.h
ENV = "GPU_SERVER_KEEP_FREED_MEMORY"
_TUNED = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_tuned() -> bool:
    """The user set glibc's malloc parameters for this process themselves."""
    return "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(v in os.environ for v in _TUNED)


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt  # type: ignore[no-any-return]


def keep_freed_memory() -> bool:
    """Set the thresholds (module docstring); True when they were set."""
    if os.environ.get(ENV, "") == "0" or user_tuned():
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def limit_arenas(n: int) -> bool:
    """At most `n` malloc arenas from now on, what MALLOC_ARENA_MAX=n gives a process from its start (a forked
    process has read its parent's environment long ago); True when set."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, n))

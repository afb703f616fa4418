"""The server keeps the memory it frees for its next records: glibc's malloc thresholds (docs/design.md §6.3).

Each record the server checks allocates and frees tensors of the same sizes as the record before it: the bench's
float64 copies and outputs in the replay worker, the outputs copied back, the metrics' temporaries. glibc hands
memory above its trim threshold back to the kernel when it is freed, and serves a request above its mmap threshold
with a mapping of its own, unmapped when freed; both adapt as the process runs, but only up to 32 MiB and 64 MiB.
The next record's tensors then take new pages, a page fault and a zeroed page for every 4 KiB, and on a virtual
machine that returns freed memory to its host the fault costs 10-25 us instead of 1.6 us (bench/first_touch.py).

`keep_freed_memory()` fixes both thresholds (protos/malloc.py) where glibc's adaptation ends: requests up to 32 MiB come
from the heap, and up to 1 GiB of freed memory at its top stays with the process, as the memory budget allows for anyway
(on bench/server.py's mid transformer: the same peak resident memory, 40 % fewer page faults). Called by gpu-server and
by each replay worker at start. It leaves alone a process whose malloc the user tuned (`GLIBC_TUNABLES` naming
glibc.malloc, or a `MALLOC_*_` variable), and does nothing with `GPU_SERVER_KEEP_FREED_MEMORY=0` or where the C library
is not glibc.
"""
from __future__ import annotations

import os

from protos import malloc
from protos.malloc import limit_arenas

__all__ = ["ENV", "TRIM_THRESHOLD", "WORKER_ARENAS", "keep_freed_memory", "limit_arenas"]

TRIM_THRESHOLD = 1 << 30
WORKER_ARENAS = 2          # a replay worker's malloc arenas (MALLOC_ARENA_MAX): its threads share two heaps
ENV = "GPU_SERVER_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Set the thresholds (module docstring); True when they were set."""
    if os.environ.get(ENV, "") == "0":
        return False
    return malloc.keep_freed(TRIM_THRESHOLD)

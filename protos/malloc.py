"""glibc's malloc thresholds, fixed so that memory a process frees is taken again without new pages: for the server
(gpu_server/malloc_policy.py) and the agent in the training's process (npu_agent/freed_memory.py); docs/design.md
§6.3 ("Freed memory stays for the next record") and §5 ("Holding the training's tensors") say why and what it
measured.

glibc hands memory at the top of its heap back to the kernel once more than its trim threshold is free there, and
serves a request above its mmap threshold with a mapping of its own, unmapped when freed. Both adapt as a process
runs, but only up to 64 MiB and 32 MiB. Memory taken again after that costs a page fault and a zeroed page for every
4 KiB. Fixing the one threshold ends glibc's adaptation of the other (mallopt), so both are always set together.
Nothing is set where the user tuned malloc for the process (`GLIBC_TUNABLES` naming glibc.malloc, or a `MALLOC_*_`
variable), nor where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Callable

MMAP_THRESHOLD = 32 << 20   # glibc's ceiling for its own adaptive threshold (DEFAULT_MMAP_THRESHOLD_MAX)
MAX_TRIM_THRESHOLD = (1 << 31) - 1   # mallopt takes an int
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8   # malloc.h
_TUNED = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_tuned() -> bool:
    """The user set glibc's malloc parameters for this process themselves."""
    return "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(v in os.environ for v in _TUNED)


def mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def keep_freed(trim_bytes: int) -> bool:
    """Requests up to MMAP_THRESHOLD from the heap, and up to `trim_bytes` (at most MAX_TRIM_THRESHOLD) of freed
    memory at its top kept by the process. True when both were set; False, and nothing set, where the user tuned
    malloc or the C library is not glibc."""
    if user_tuned():
        return False
    fn = mallopt()
    if fn is None:
        return False
    trim = max(0, min(int(trim_bytes), MAX_TRIM_THRESHOLD))
    return bool(fn(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(fn(_M_TRIM_THRESHOLD, trim))


def limit_arenas(n: int) -> bool:
    """At most `n` malloc arenas from now on, what MALLOC_ARENA_MAX=n gives a process from its start (a forked
    process has read its parent's environment long ago); True when set."""
    fn = mallopt()
    return fn is not None and bool(fn(_M_ARENA_MAX, n))

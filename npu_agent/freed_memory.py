"""The training's freed memory stays with its process while the agent holds records (docs/design.md §5, "Holding
the training's tensors").

The agent holds the tensors of each record it captured by reference until its sender has written them, up to
`tensor.online_memory_mb`. Meanwhile the training frees the memory of the tensors it no longer needs and allocates
its next ones: they come from the top of glibc's heap, which the held records push up by as much as they hold.
Once the sender lets a step's records go, most of that top is free at once, and glibc hands it back to the kernel
(beyond its trim threshold, at most 64 MiB). The next step's tensors take it again as new pages, a page fault and a
zeroed page for every 4 KiB, on the training's thread: on bench/overhead.py --agent-alone's mid transformer, 31,885
page faults a step with the agent against 6,123 without it, and the step 1.15x longer.

`keep_for_held(memory_bytes)` fixes glibc's thresholds (protos/malloc.py) so that requests up to 32 MiB come from the
heap and the memory the agent may hold, plus glibc's own 64 MiB, stays with the process once freed: the process
keeps what its peak took anyway, and the next step reuses it. Set when the agent starts, unless
`tensor.online_keep_freed_memory` is false, the user tuned malloc (`GLIBC_TUNABLES` naming glibc.malloc, or a
`MALLOC_*_` variable) or the C library is not glibc. The records and the training's results are the same either way.
"""
from __future__ import annotations

import logging

from protos import malloc

log = logging.getLogger("npu_agent")

_kept = [0]   # the trim threshold this process set so far (several debuggers: the largest budget wins)


def keep_for_held(memory_bytes: int) -> bool:
    """Keep up to `memory_bytes` (what the agent's records may hold) plus glibc's own adaptive maximum of freed
    memory; True when the thresholds are set (now or by an earlier call with at least as much)."""
    trim = min(int(memory_bytes) + 2 * malloc.MMAP_THRESHOLD, malloc.MAX_TRIM_THRESHOLD)
    if trim <= _kept[0]:
        return True
    try:
        kept = malloc.keep_freed(trim)
    except Exception as exc:  # noqa: BLE001 - never raise into the training: glibc's own thresholds stay
        log.debug("online check: setting malloc's thresholds failed (%s: %s)", type(exc).__name__, exc)
        return False
    if not kept:
        log.debug("online check: malloc's thresholds left as they are (tuned by the user, or not glibc)")
        return False
    _kept[0] = trim
    log.info("online check: up to %d MiB of memory the training frees stays with the process while records hold "
             "tensors (tensor.online_keep_freed_memory)", trim >> 20)
    return True

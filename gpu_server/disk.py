"""A full disk pauses the server instead of losing or skipping anything.

Writers that meet ENOSPC/EDQUOT (the spool's group commit, a report row) undo their partial write, call
`wait_for_space`, and try again: records stop being acknowledged, the memory budget fills, and the agents slow
down (policy `block`) until space is freed. Once the server is stopping, a writer gives up after `STOP_GRACE_S`:
what it could not write stays in the spool for a restart with the same --out.
"""
from __future__ import annotations

import errno
import logging
import threading
import time

log = logging.getLogger("gpu_server")

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
RETRY_S = 0.5
STOP_GRACE_S = 10.0
_SAY_EVERY_S = 30.0

stopping = threading.Event()      # set by the server once it drains (gpu_server/app.py)
_lock = threading.Lock()
_last_said = 0.0
full_events = 0                   # times a writer met a full disk (the summary reports it)


def is_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def wait_for_space(where: str, since: float) -> bool:
    """Called after a write failed for lack of space (the partial write undone). Sleeps and returns True to retry;
    False once the server is stopping and has waited STOP_GRACE_S since `since` (time.monotonic())."""
    global _last_said, full_events
    now = time.monotonic()
    with _lock:
        full_events += 1
        say = now - _last_said >= _SAY_EVERY_S
        if say:
            _last_said = now
    if say:
        log.error("disk full while writing %s: checking and acknowledgements are paused (the agents wait, nothing "
                  "is lost); free space on that file system (or lower --error-data-max-mb) and the server goes on",
                  where)
    if stopping.is_set() and now - since >= STOP_GRACE_S:
        return False
    time.sleep(RETRY_S)
    return True

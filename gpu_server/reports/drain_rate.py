"""The rate part of the live progress line: records/s arriving and checked, the backlog, and the time left to drain.

`DrainRate.line(received, backlog)` is called with the records received so far and the records still waiting (held
in the spool, not completely reported); it keeps a sliding window of those samples and derives the rates from it.
"""
from __future__ import annotations

import collections
import time
from typing import Callable


class DrainRate:
    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._samples: collections.deque = collections.deque()   # (t, received, done)

    def rates(self, received: int, backlog: int) -> tuple[float, float, float | None]:
        """(records/s in, records/s checked, seconds left to drain; None when nothing drains while a backlog
        waits)."""
        now, done = self._clock(), max(0, received - backlog)
        self._samples.append((now, received, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, r0, d0 = self._samples[0]
        dt = now - t0
        rate_in = (received - r0) / dt if dt > 0 else 0.0
        rate_done = (done - d0) / dt if dt > 0 else 0.0
        if backlog <= 0:
            return rate_in, rate_done, 0.0
        return rate_in, rate_done, (backlog / rate_done if rate_done > 0 else None)

    def line(self, received: int, backlog: int) -> str:
        rate_in, rate_done, left = self.rates(received, backlog)
        eta = "-" if left is None else (f"{left:.0f} s" if left < 120 else f"{left / 60:.1f} min")
        return f"{rate_in:.1f} rec/s in, {rate_done:.1f} rec/s checked, backlog {backlog}, drain in {eta}"

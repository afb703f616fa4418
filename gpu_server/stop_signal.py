"""SIGTERM and SIGINT as a request to drain, taken without a lock (docs/design.md §6.1).

Python runs a signal handler in the main thread, between two of its bytecodes, wherever that thread is. The command
line used to wait on a `threading.Event` (`stop.wait(2.0)`) and set it from the handler; when the signal came while
the main thread was inside `Event.wait` holding the event's lock (on its way in or out of the timed wait), the
handler's `Event.set` waited for that same lock, held by the thread it ran on, forever: a SIGTERM left the server
hung instead of drained. It happened when the signal came as the timed wait ended, e.g. at once after a SIGCONT.

Here the handler only stores the signal's number and writes a byte to a pipe (a system call, no lock of Python's),
and `wait` sleeps in `select` on that pipe: it returns as soon as a signal has come, or after its timeout.
"""
from __future__ import annotations

import os
import select
import signal
from types import FrameType


class StopSignal:
    """`install(*signums)` (the command line: SIGTERM and SIGINT); `wait(timeout)` until one comes; `name` of the
    first."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)

    def install(self, *signums: int) -> "StopSignal":
        for signum in signums:
            signal.signal(signum, self.handler)
        return self

    def handler(self, signum: int, _frame: FrameType | None) -> None:
        """The signal handler: no lock, no logging (the main thread may be inside either)."""
        if self.signum is None:
            self.signum = signum
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:   # the pipe is full of earlier signals' bytes: `wait` wakes anyway
            pass

    def is_set(self) -> bool:
        return self.signum is not None

    def wait(self, timeout: float) -> bool:
        """Sleep until a signal has come (at once if one came before) or `timeout` seconds pass; whether one came."""
        if self.signum is None:
            ready, _, _ = select.select([self._r], [], [], timeout)
            if ready:
                os.read(self._r, 4096)
        return self.is_set()

    def close(self) -> None:
        """Close the pipe (the handlers stay installed: `install` others first)."""
        for fd in (self._r, self._w):
            os.close(fd)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

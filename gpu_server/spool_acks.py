"""Acknowledgements: a `Ticket` per record, set once the record is durable (or at once for immediate answers)."""
from __future__ import annotations

import threading


class Ticket:
    """The acknowledgement of one record, ready once the record is durable (or at once for immediate answers)."""

    __slots__ = ("_event", "status", "reason", "seq", "after")

    def __init__(self, seq: int = 0, status: int | None = None, reason: str = "", after: Ticket | None = None):
        self._event = threading.Event()
        self.seq, self.status, self.reason = seq, status, reason
        self.after = after   # answer only once this earlier ticket is ready (a duplicate, a spooled rejection)
        if status is not None:
            self._event.set()

    def set(self, status: int, reason: str = "") -> None:
        if not self._event.is_set():
            self.status, self.reason = status, reason
            self._event.set()

    def ready(self) -> bool:
        return self._event.is_set() and (self.after is None or self.after.ready())

    def wait(self, timeout: float | None = None) -> tuple[int, str]:
        if self.after is not None:
            self.after.wait(timeout)
        self._event.wait(timeout)
        return self.status, self.reason

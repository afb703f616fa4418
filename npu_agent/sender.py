"""The background sender: a bounded queue between the training thread and the transport (SPEC §3.3, §4).

The training thread only calls `submit()`. Everything else (host copies, encoding, sending, acknowledgements,
re-sending after a reconnect) happens on the sender's own thread and the transport's threads.

Memory: a record counts against the budget from `submit()` until the server acknowledges it (it is kept for
re-sending until then). At the budget, the policy applies: `block` waits (nothing is lost), `drop` drops the newest
record and counts it. One record larger than the whole budget is sent alone (blocking) rather than never.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

from npu_agent.records import PendingRecord

log = logging.getLogger("npu_agent")


class Counts:
    def __init__(self) -> None:
        self.captured = 0
        self.sent = 0
        self.acknowledged = 0
        self.rejected = 0
        self.dropped = 0
        self.duplicates = 0

    def as_dict(self) -> dict:
        return dict(vars(self))


class Sender:
    def __init__(self, transport, budget_bytes: int, policy: str = "block"):
        self.transport = transport
        self.budget = budget_bytes
        self.policy = policy
        self.counts = Counts()
        self._cv = threading.Condition()
        self._queue: collections.deque[PendingRecord] = collections.deque()
        self._unacked: dict[int, PendingRecord] = {}
        self._held = 0                     # bytes of records submitted and not yet acknowledged
        self._next_seq = 0
        self._resend = False
        self._resend_gen = 0
        self._gen = 0                      # the transport stream the queue's order is valid for
        self._generations = hasattr(transport, "generation")
        self._closing = False
        self._warned_block = 0.0
        self._thread = threading.Thread(target=self._run, name="online-check-sender", daemon=True)
        transport.on_ack = self._on_ack
        transport.on_reconnect = self._on_reconnect
        self._thread.start()
        start = getattr(transport, "start", None)
        if start is not None:   # the transport connects only now: no stream notification can be missed
            start()

    # -- training thread -----------------------------------------------------------------------------------
    def submit(self, rec: PendingRecord) -> bool:
        size = rec.nbytes
        with self._cv:
            self.counts.captured += 1
            while self._held + size > self.budget and self._held > 0:
                if self.policy == "drop" or self._closing:
                    self.counts.dropped += 1
                    return False
                now = time.monotonic()
                if now - self._warned_block > 30:
                    self._warned_block = now
                    log.warning("online check: %d MiB of records are waiting for the server (budget %d MiB); the "
                                "training waits (policy 'block'). %s", self._held >> 20, self.budget >> 20,
                                self.transport.describe_state())
                self._cv.wait(1.0)
            rec.seq = self._next_seq
            self._next_seq += 1
            self._held += size
            self._unacked[rec.seq] = rec
            self._queue.append(rec)
            self._cv.notify_all()
        return True

    # -- sender thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._resend and not self._closing:
                    self._cv.wait()
                if self._resend:
                    # A new stream: everything not acknowledged goes again, in sequence order, before anything new
                    # (the server checks a rank's records in arrival order: a backward must follow its forward).
                    self._resend = False
                    self._gen = self._resend_gen
                    self._queue = collections.deque(sorted(self._unacked.values(), key=lambda r: r.seq))
                if not self._queue:
                    if self._closing:
                        return
                    continue
                rec = self._queue.popleft()
                gen = self._gen
            try:
                sent = self.transport.send_record(rec, gen) if self._generations else self.transport.send_record(rec)
            except Exception as exc:  # noqa: BLE001 - an encoding bug must not stop the sender
                log.warning("online check: could not encode %s (%s: %s); it is reported as lost", rec.name,
                            type(exc).__name__, exc)
                self._release(rec.seq, rejected=True)
                continue
            with self._cv:
                if sent is False:
                    # The stream changed under us: wait for the re-send that the new stream triggers (the record
                    # stays in _unacked and goes out again in order).
                    while not self._resend and not self._closing:
                        self._cv.wait(1.0)
                    continue
                self.counts.sent += 1

    # -- transport callbacks -------------------------------------------------------------------------------
    def _on_ack(self, seq: int, status: str, reason: str) -> None:
        if status == "REJECTED":
            log.warning("online check: the server rejected record %d: %s", seq, reason)
        self._release(seq, rejected=(status == "REJECTED"), duplicate=(status == "DUPLICATE"))

    def _release(self, seq: int, rejected: bool = False, duplicate: bool = False) -> None:
        with self._cv:
            rec = self._unacked.pop(seq, None)
            if rec is None:
                return
            self._held -= rec.nbytes
            if rejected:
                self.counts.rejected += 1
            else:
                self.counts.acknowledged += 1
                self.counts.duplicates += duplicate
            self._cv.notify_all()

    def _on_reconnect(self, generation: int = 0) -> None:
        with self._cv:
            self._resend = True
            self._resend_gen = generation
            self._cv.notify_all()

    # -- end of stream -------------------------------------------------------------------------------------
    def close(self, timeout: float) -> dict:
        """Wait until every record is acknowledged (or `timeout`), send the end message, return the counts."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while (self._unacked or self._queue) and time.monotonic() < deadline:
                self._cv.wait(min(1.0, max(0.01, deadline - time.monotonic())))
            self._closing = True
            self._cv.notify_all()
            lost = len(self._unacked)
        # With records still unacknowledged the sender thread may be waiting on a server that is gone: do not wait
        # long for it (it is a daemon thread; the transport's close ends its wait).
        self._thread.join(timeout=0.5 if lost else 5)
        counts = self.counts.as_dict()
        counts["unacknowledged"] = lost
        counts["last_seq"] = self._next_seq
        self.transport.send_end(counts, max(1.0, deadline - time.monotonic()))
        return counts

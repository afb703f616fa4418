"""Acknowledgements: a `Ticket` per record, set once the record is durable (or at once for immediate answers), and
the group commit that makes records durable (`GroupCommit`)."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from gpu_server import disk
from gpu_server.spool.segments import segment_path, write_segment
from protos import online_check_pb2 as pb

log = logging.getLogger("gpu_server")

BATCH_BYTES = 256 << 20        # one group commit writes at most this much (then the next batch starts)


_ANSWERED = threading.Event()
_ANSWERED.set()


class Ticket:
    """The acknowledgement of one record, ready once the record is durable (or at once for immediate answers)."""

    __slots__ = ("_event", "status", "reason", "seq", "after")

    def __init__(self, seq: int = 0, status: int | None = None, reason: str = "", after: Ticket | None = None):
        # An answer known at once shares one event that is set for good (most records of a busy stream).
        self._event = _ANSWERED if status is not None else threading.Event()
        self.seq, self.status, self.reason = seq, status, reason
        self.after = after   # answer only once this earlier ticket is ready (a duplicate, a spooled rejection)

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


class GroupCommit:
    """Records appended by the transports -> one spool segment per batch (group commit) -> their tickets set.

    One fsync per batch of records arriving together, whatever the number of streams. A full disk pauses the
    commits (nothing acknowledged meanwhile, gpu_server/disk.py); another write error falls back to acknowledging
    each record once its rows are written (`reported`). Shares the spool's lock (`cv`): `on_durable(seg, keys)`
    runs under it, with the keys of the batch not already reported.
    """

    def __init__(self, cv: threading.Condition, spool_dir: str, fsync: bool,
                 on_durable: Callable[[int, list], None], unlink: Callable[[int], None]):
        self.cv = cv
        self.dir = spool_dir
        self.fsync = fsync
        self.on_durable = on_durable
        self.unlink = unlink
        self.stats = {"segments": 0, "records": 0, "bytes": 0, "fsyncs": 0}
        self._queue: list[tuple[tuple, bytes, Any, Ticket, int]] = []
        self._inflight: dict[tuple, Ticket] = {}     # appended, not yet durable
        self._done_early: set[tuple] = set()         # completely reported before its segment was durable
        self._fallback: dict[tuple, Ticket] = {}     # could not be spooled: acknowledged once reported
        self._next = 0
        self._closed = False
        self._failed_once = False
        self._thread: threading.Thread | None = None

    def start(self, next_segment: int) -> None:
        self._next = next_segment
        self._thread = threading.Thread(target=self._loop, name="gpu-server-spool", daemon=True)
        self._thread.start()

    def append(self, key: tuple, header: bytes, payload) -> Ticket:
        ticket = Ticket(key[2])
        with self.cv:
            if self._closed:
                raise RuntimeError("the spool is closed")
            self._inflight[key] = ticket
            self._queue.append((key, header, payload, ticket, len(payload)))
            self.cv.notify_all()
        return ticket

    def pending(self, key: tuple) -> Ticket | None:
        with self.cv:
            return self._inflight.get(key) or self._fallback.get(key)

    def reported(self, keys) -> None:
        """Rows written for `keys`: a record that could not be spooled is acknowledged now."""
        with self.cv:
            for key in keys:
                t = self._fallback.pop(key, None)
                if t is not None:
                    t.set(pb.Ack.ACCEPTED)

    def done_before_durable(self, key: tuple) -> None:
        """(Under `cv`.) `key` is journaled done; if its segment is not durable yet, it will not be kept there."""
        if key in self._inflight:
            self._done_early.add(key)

    def busy(self) -> bool:
        """(Under `cv`.)"""
        return bool(self._queue or self._inflight)

    def inflight(self) -> int:
        with self.cv:
            return len(self._inflight)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self._queue and not self._closed:
                    self.cv.wait()
                if not self._queue:
                    return
                batch, size = [], 0
                while self._queue and (not batch or size + self._queue[0][4] <= BATCH_BYTES):
                    item = self._queue.pop(0)
                    batch.append(item)
                    size += item[4]
                seg = self._next
                self._next += 1
            if not self._commit(seg, batch):
                continue
            with self.cv:
                live = []
                for key, _h, _p, _t, _n in batch:
                    self._inflight.pop(key, None)
                    if key in self._done_early:
                        self._done_early.discard(key)
                    else:
                        live.append(key)
                self.on_durable(seg, live)
                self.stats["segments"] += 1
                self.stats["records"] += len(batch)
                self.stats["bytes"] += size
                self.cv.notify_all()
            if not live:
                self.unlink(seg)
            for *_rest, ticket, _n in batch:
                ticket.set(pb.Ack.ACCEPTED)

    def _commit(self, seg: int, batch) -> bool:
        """Write one segment; on a full disk wait and retry. False: not durable (and never acknowledged as such)."""
        since = time.monotonic()
        while True:
            try:
                write_segment(segment_path(self.dir, seg), [(h, p) for _k, h, p, _t, _n in batch], self.fsync)
                if self.fsync:
                    self.stats["fsyncs"] += 1
                    _fsync_dir(self.dir)
                return True
            except OSError as exc:
                if disk.is_full(exc) and disk.wait_for_space(self.dir, since):
                    continue
                with self.cv:
                    for key, _h, _p, ticket, _n in batch:
                        self._inflight.pop(key, None)
                        if disk.is_full(exc):      # stopping with the disk still full: the agents re-send
                            self._done_early.discard(key)
                        elif key in self._done_early:
                            self._done_early.discard(key)
                            ticket.set(pb.Ack.ACCEPTED)
                        else:
                            self._fallback[key] = ticket
                    self.cv.notify_all()
                if not disk.is_full(exc) and not self._failed_once:
                    self._failed_once = True
                    log.error("spool: cannot write %s (%s); records are acknowledged only once their rows are "
                              "written, and are not kept across a restart", self.dir, exc)
                return False

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""The server's memory budget (`--memory-mb`): `ByteBudget` (bytes reserved by whatever transport brought a
record, waited for in arrival order), `ConnectionShare` (one connection's fair share of it) and
`check_peak`, what a complete record holds until it is checked (docs/security.md, "Memory")."""
from __future__ import annotations

import asyncio
import bisect
import threading
import time
from typing import Callable

from gpu_server.compiled import DECODE
from protos import online_check_pb2 as pb

# What checking a record costs, per byte of each tensor it carries, by dtype: (tensors the check compares: the
# output, or the gradients of a backward record; every other tensor). The factor includes the tensor's own bytes.
# Measured on the CPU bench with process replays (the default: the payload, its copy in shared memory for the replay
# worker, the bench run's upcast, the same-dtype run, for a failing output the stochastic-rounding runs, and the
# float64 metrics per element), on relu, gelu, add, matmul and sum of 8-32 Mi elements, peak RSS of the server and its
# replay worker, plus about a quarter (docs/security.md, "Memory"). A dtype of one byte pays per element what a wider
# one does: its factors are larger.
PEAK_FACTORS: dict[str, tuple[int, int]] = {
    "float16": (80, 11), "bfloat16": (80, 11),
    "float32": (64, 11), "complex64": (64, 11),
    "float64": (24, 9), "complex128": (24, 9),
    "float8_e4m3fn": (160, 16), "float8_e5m2": (160, 16), "float8_e4m3fnuz": (160, 16), "float8_e5m2fnuz": (160, 16),
    "bool": (160, 8), "int8": (160, 8), "uint8": (160, 8),
    "int16": (80, 8), "uint16": (80, 8),
    "int32": (40, 8), "uint32": (40, 8),
    "int64": (20, 8), "uint64": (20, 8),
}
HEADER_FACTOR = 16   # a record's header (names, shapes, argument values) parsed and decoded into objects


def check_peak(record: pb.Record, base: int, raw: bytes | None = None) -> int:
    """Bytes of the memory budget a complete record holds until it is checked (its estimated peak).

    `base`: the bytes it holds as it arrived (its header and payload), counted as they came. Added: each tensor's
    bytes times its factor from `PEAK_FACTORS` (minus the one already in `base`), and the header's bytes times
    `HEADER_FACTOR`. Sizes are the client's claims, each cut to the payload (a record whose table does not match its
    payload is rejected when it is decoded), so the estimate never exceeds what they could cost. `raw`: the record's
    bytes, where the caller has them: read in C where gpu_server/_fastdecode.c is built (the same estimate; a record
    it does not read is estimated here).
    """
    if raw is not None:
        fast = DECODE.load()
        if fast is not None:
            peak: int | None = fast.peak(raw, base, PEAK_FACTORS, HEADER_FACTOR)
            if peak is not None:
                return peak
    payload = record.payload_bytes
    compared = _compared_tensors(record)
    total = base + max(0, base - payload) * (HEADER_FACTOR - 1)
    for i, meta in enumerate(record.tensors):
        factors = PEAK_FACTORS.get(meta.dtype)
        if factors is not None:
            total += min(meta.nbytes, payload) * ((factors[0] if i in compared else factors[1]) - 1)
    return total


def _compared_tensors(record: pb.Record) -> set[int]:
    """Indices of the tensors in a record's output (forward) and grad_input (backward) trees."""
    out: set[int] = set()
    stack = [v for v, present in ((record.output, record.HasField("output")),
                                  (record.grad_input, record.HasField("grad_input"))) if present]
    seen = 0
    while stack and seen < 1_000_000:   # Limits.max_values: a longer tree is rejected when it is decoded
        v = stack.pop()
        seen += 1
        kind = v.WhichOneof("kind")
        if kind == "tensor":
            out.add(v.tensor)
        elif kind in ("tuple", "list", "size", "named_tuple"):
            stack.extend(getattr(v, kind).items)
        elif kind == "dict":
            stack.extend(v.dict.values)
    return out


class ByteBudget:
    """Bytes the server holds at once (`--memory-mb`): messages as they arrive, half-received records, and each
    complete record at its estimated peak (`check_peak`) until the workers have checked it.

    Waiters (threads with `acquire`, event-loop coroutines with `acquire_async`; `n` = 0: room to read one more
    message, granted while less than the limit is held) are granted in order (oldest record first, then arrival) as
    soon as their bytes fit; a later, smaller request may pass one that does not fit yet, unless that one has waited
    longer than `AGING_S` (then everything queues behind it, so a large record is never starved). A waiter that holds
    `own` bytes itself gets through when nobody else holds anything. Bytes already in memory (a message gRPC handed
    over) are counted with `force`, without waiting.

    Deadlock: when every byte held belongs to waiters (half-received records whose streams wait for room, complete
    ones waiting for their peak), nothing held can be released until one of them goes on: the first waiter holding
    bytes (the oldest record) is let through beyond the limit (`overdrawn` counts it), once at a time.
    """

    AGING_S = 1.0

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.peak = 0
        self.overdrawn = 0
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []    # in grant order (`_Waiter.key`)
        self._waiting_own = 0                # what the waiters hold themselves
        self._arrivals = 0

    def _fits(self, w: _Waiter) -> bool:
        if self.held <= w.own:
            return True   # nobody else holds anything
        return self.held < self.limit if w.n == 0 else self.held + w.n <= self.limit

    def _take(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def force(self, n: int) -> None:
        """Count `n` bytes that are in memory already (nothing waits)."""
        if n:
            with self._lock:
                self._take(n)

    def has_room(self, own: int = 0) -> bool:
        """True when one more message may be read now (nobody waits, and less than the limit is held, or only `own`)."""
        with self._lock:
            return not self._waiters and (self.held < self.limit or self.held <= own)

    def _enter(self, waiter: _Waiter) -> bool:
        """Under the lock: take the bytes now (True) or queue the waiter."""
        now = time.monotonic()
        if self._fits(waiter) and not any(now - w.since > self.AGING_S for w in self._waiters[:1]):
            self._take(waiter.n)
            return True
        self._arrivals += 1
        waiter.key = (waiter.order, self._arrivals)
        bisect.insort(self._waiters, waiter, key=lambda w: w.key)
        self._waiting_own += waiter.own
        self._grant_locked()
        return waiter.granted

    def _remove(self, waiter: _Waiter) -> None:
        self._waiters.remove(waiter)
        self._waiting_own -= waiter.own

    def stuck(self, n: int) -> None:
        """`n` bytes held by a stream that waits for something else than this budget (its connection's share): they
        cannot be released until it goes on, like a waiter's own bytes (`unstuck` when it does)."""
        with self._lock:
            self._waiting_own += n
            self._grant_locked()

    def unstuck(self, n: int) -> None:
        with self._lock:
            self._waiting_own -= n

    def _leave(self, waiter: _Waiter) -> bool:
        """Under the lock: withdraw a waiter that gives up; True when it was granted meanwhile."""
        if waiter.granted or waiter not in self._waiters:
            return waiter.granted
        self._remove(waiter)
        self._grant_locked()
        return False

    def acquire(self, n: int, cancelled: Callable[[], bool] = lambda: False, own: int = 0,
                order: float | None = None) -> bool:
        """Wait (a thread) until `n` bytes are granted (`n` = 0: room for one more message). `own`: bytes the caller
        holds already; `order`: when its record started (older first). False when `cancelled()` meanwhile."""
        waiter = _Waiter(n, own, order, event=threading.Event())
        with self._lock:
            if self._enter(waiter):
                return True
        assert waiter.event is not None
        while not waiter.event.wait(0.5):
            if cancelled():
                with self._lock:
                    if not self._leave(waiter):
                        return False
                return True
        return True

    async def acquire_async(self, n: int, own: int = 0, order: float | None = None) -> None:
        """`acquire` without holding a thread. Cancelling the wait gives nothing back that was not granted, and
        gives back what was."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(n, own, order, future=loop.create_future(), loop=loop)
        with self._lock:
            if self._enter(waiter):
                return
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                granted = self._leave(waiter)
            if granted:
                self.release(n)
            raise

    def release(self, n: int) -> None:
        if n:
            with self._lock:
                self.held -= n
                self._grant_locked()

    def _grant_locked(self) -> None:
        now = time.monotonic()
        for waiter in list(self._waiters):
            if self._fits(waiter):
                self._remove(waiter)
                self._take(waiter.n)
                waiter.grant()
            elif now - waiter.since > self.AGING_S:
                break   # it waited long enough: nobody passes it any more
        if self._waiters and self.held <= self._waiting_own:
            # every byte held is a waiter's (or a stream's stuck behind its connection's share): the oldest record
            # goes on, beyond the limit (not a stream holding nothing: letting it read would only bring in more)
            oldest = next((w for w in self._waiters if w.own > 0), None)
            if oldest is not None:
                self._remove(oldest)
                self._take(oldest.n)
                self.overdrawn += 1
                oldest.grant()


class _Waiter:
    __slots__ = ("n", "own", "order", "key", "event", "future", "loop", "since", "granted")

    def __init__(self, n: int, own: int, order: float | None, event: threading.Event | None = None, future=None,
                 loop=None):
        self.n, self.own, self.event, self.future, self.loop = n, own, event, future, loop
        self.since = time.monotonic()
        self.order = self.since if order is None else order
        self.key: tuple[float, int] = (self.order, 0)
        self.granted = False

    def grant(self) -> None:
        self.granted = True
        if self.event is not None:
            self.event.set()
            return
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future)
        except RuntimeError:  # the event loop is closed (server stopped): nobody waits any more
            pass


def _resolve(future) -> None:
    if not future.done():
        future.set_result(None)


class ConnectionShare:
    """What the streams of one connection hold at the intake (messages, half-received records, complete records
    until the workers take them), against `limit` (`--connection-memory-mb`): while the connection holds that much,
    only its oldest half-received record is read on (so it completes and frees its share), no other stream of it
    reads anything, and one connection cannot fill the budget with records it never finishes."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._partials: dict[int, float] = {}   # stream token -> when its half-received record started
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def add(self, n: int) -> None:
        with self._lock:
            self.held += n

    def release(self, n: int) -> None:
        if n:
            with self._lock:
                self.held -= n
            self._wake()

    def started(self, token: int, when: float) -> None:
        """A stream of this connection began a record that comes in several messages."""
        with self._lock:
            self._partials[token] = when

    def ended(self, token: int) -> None:
        with self._lock:
            gone = self._partials.pop(token, None)
        if gone is not None:
            self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:
                pass

    def may_read(self, token: int) -> bool:
        """Below the limit, any stream; at it, only the one whose record is the connection's oldest."""
        with self._lock:
            if self.held < self.limit:
                return True
            when = self._partials.get(token)
            return when is not None and when <= min(self._partials.values())

    async def wait_room(self, token: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            future = loop.create_future()
            with self._lock:
                self._waiters.append((loop, future))
            if self.may_read(token):
                return
            try:
                await future
            finally:
                with self._lock:
                    if (loop, future) in self._waiters:
                        self._waiters.remove((loop, future))

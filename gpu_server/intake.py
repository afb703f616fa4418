"""Accepting records, whatever transport brought them (docs/security.md, "Who can reach the port or the folder").

`FrameAssembler` joins one stream's frames into (Record, payload), reserving the payload's bytes from the server's
memory budget first (`ByteBudget`, after `admit` refused a record above `Limits.max_record_bytes`). `Intake.submit`
drops duplicates (same run, rank, seq), applies the rank and API filters, validates the whole record (header, strict
names, tensor table, every value decoded, the replay registry) and only then writes it to the durable spool
(gpu_server/spool.py) and hands the decoded `Job` to the workers; it returns a `Ticket` that holds the
acknowledgement once the record is durable. A record that fails validation is answered REJECTED at once with the
reason and a SKIP row, and is never spooled; it is counted `rejected` when it breaks the wire contract (malformed,
hostile, refused sizes or names) and `not_replayable` when it is valid but cannot be replayed here (its arguments, an
API this host lacks). `Intake.accept` is the same, waiting for the ticket. `Intake.end_backed`
says whether an end message may count (its run and rank sent records).
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import mmap
import queue
import re
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

from gpu_server.collective_info import CollectiveError, from_wire
from gpu_server.config import ServerConfig
from gpu_server.job import Job
from gpu_server.registry import name_refused, replayable
from gpu_server.seqset import SeqSet
from protos import online_check_pb2 as pb
from protos.apis import COLLECTIVES, POINT_TO_POINT
from protos.codec import RecordDecoder, WireError
from protos.framing import split_batch
from protos.limits import DEFAULT_LIMITS, RUN_ID, Limits, MiB, log_text, valid_call_name

log = logging.getLogger("gpu_server")

if TYPE_CHECKING:
    from gpu_server.spool import Spool, Ticket

ACCEPTED, DUPLICATE, REJECTED = pb.Ack.ACCEPTED, pb.Ack.DUPLICATE, pb.Ack.REJECTED


MAX_WHERE = 1024   # characters kept of a record's module path and source location


def wire_text(value: str, limit: int = MAX_WHERE) -> str:
    """A free-text header field (module, source) as the reports keep it: as sent when short and printable, else cut
    to `limit` characters and escaped (protos.limits.log_text). Never a reason to reject the record."""
    if len(value) <= limit and value.isprintable():
        return value
    return log_text(value, limit)


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


def check_peak(record: pb.Record, base: int) -> int:
    """Bytes of the memory budget a complete record holds until it is checked (its estimated peak).

    `base`: the bytes it holds as it arrived (its header and payload), counted as they came. Added: each tensor's
    bytes times its factor from `PEAK_FACTORS` (minus the one already in `base`), and the header's bytes times
    `HEADER_FACTOR`. Sizes are the client's claims, each cut to the payload (a record whose table does not match its
    payload is rejected when it is decoded), so the estimate never exceeds what they could cost.
    """
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


class FrameAssembler:
    """One stream's frames -> complete records, every byte counted in the memory budget as it arrives.

    The caller counts each message it has in hand (`arrived`: gRPC handed it over already; `reserve`: the folder
    reserves before it reads), asks `before(frame, data)` what more the frame needs (when it completes a record: the
    rest of the record's estimated peak, `check_peak`), reserves that and tells `granted`, then `feed`s the frame;
    what the message held and no record kept is given back with `drop_loose`. A record's bytes are held from the
    moment they arrive, never before: a header announcing 60 GiB holds its own bytes only (and one announcing more than
    `Limits.max_record_bytes`, or needing more than the whole budget to be checked, is refused at once; its chunks are
    dropped unread, without an answer each). The record being assembled must keep coming (`deadline`, `late`).
    Without a budget (tests, offline tools) nothing is counted.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS, budget: ByteBudget | None = None,
                 cancelled: Callable[[], bool] = lambda: False, share: ConnectionShare | None = None):
        self.limits = limits
        self.budget = budget
        self.cancelled = cancelled
        self.share = share
        self.record: pb.Record | None = None
        self.payload: mmap.mmap | None = None   # written as the chunks arrive: pages are taken as they are written
        self._first: bytes | memoryview = b""     # the first frame's data, until the second frame comes
        self.filled = 0
        self.refused_seq: int | None = None
        self._admitted: pb.Frame | None = None   # the record frame `before` admitted, until it is fed
        self.held = 0          # budget bytes of the record being assembled (the messages its bytes came in, and
        self._held_recv = 0    # its peak once complete); of them, received (what its connection holds)
        self.loose = 0         # budget bytes of the message in hand, not yet part of a record
        self._loose_recv = 0
        self.extra = 0         # budget bytes granted for the message in hand beyond it: the rest of a record's peak
        self.reserved = 0      # of the record `feed` just returned, until `take_reserved`
        self._reserved_recv = 0
        self.need = 0          # the estimated peak of the record being assembled, once complete
        self.started = self.last = 0.0
        self.waited = 0.0      # seconds the stream waited for the budget while this record was half received
        self.share_waited = 0.0  # ... and for its connection to hold less than its share (its own doing: counted)
        self._waited_at_last = 0.0
        self._wait_since: float | None = None

    # -- counting ------------------------------------------------------------------------------------------------
    @property
    def holding(self) -> int:
        """Budget bytes this stream holds now."""
        return self.held + self.loose + self.extra + self.reserved

    def arrived(self, n: int) -> None:
        """A message of `n` bytes is in memory: count it (the budget may go over its limit: it is there)."""
        self.loose += n
        self._loose_recv += n
        if self.budget is not None:
            self.budget.force(n)
        if self.share is not None:
            self.share.add(n)

    def reserve(self, n: int) -> bool:
        """Reserve `n` bytes for a message about to be read (waits for the budget; False when cancelled)."""
        if self.budget is not None and not self.budget.acquire(n, self.cancelled, own=self.holding,
                                                               order=self.started or None):
            return False
        self.loose += n
        self._loose_recv += n
        if self.share is not None:
            self.share.add(n)
        return True

    def granted(self, n: int) -> None:
        """`n` more bytes were granted for the message in hand (the rest of its record's peak): the record it
        completes takes them."""
        self.extra += n

    def drop_loose(self) -> None:
        """Give back what the message in hand held and no record kept."""
        self._give(self.loose, self._loose_recv)
        self.loose = self._loose_recv = 0

    def _give(self, n: int, recv: int) -> None:
        if self.budget is not None and n:
            self.budget.release(n)
        if self.share is not None and recv:
            self.share.release(recv)

    def _keep(self, n: int | None = None) -> None:
        """`n` bytes of the message in hand (all of it by default) become part of the record being assembled."""
        n = self.loose if n is None else min(n, self.loose)
        recv = min(n, self._loose_recv)
        self.held += n
        self._held_recv += recv
        self.loose -= n
        self._loose_recv -= recv

    # -- records -------------------------------------------------------------------------------------------------
    def admit(self, frame: pb.Frame) -> int:
        """Check a record header against the limits before anything is held for it; returns its payload size."""
        cut = self.cut_off()
        if cut is not None:
            raise WireError(cut[1])
        rec = frame.record
        self.refused_seq = None
        if rec.payload_bytes > self.limits.max_record_bytes:
            self.refused_seq = rec.header.seq
            raise WireError(f"record {rec.header.seq} announces {rec.payload_bytes} payload bytes "
                            f"({rec.payload_bytes / MiB:.1f} MiB), above the limit of {self.limits.max_record_bytes} "
                            f"({self.limits.max_record_bytes / MiB:.1f} MiB) of what this server can hold (gpu-server "
                            f"--max-record-mb, by default half of --memory-mb: raise them on the server, or capture "
                            f"fewer or smaller tensors with tensor.list / tensor.scope)")
        return rec.payload_bytes

    def cut_off(self) -> tuple[int, str] | None:
        """Drop the half-received record that the next record cuts off: (its seq, why it is refused), or None."""
        if self.record is None:
            return None
        seq, filled = self.record.header.seq, self.filled
        self.reset()
        return seq, f"record {seq} was cut off by the next record after {filled} bytes"

    def _admit_once(self, frame: pb.Frame) -> None:
        """`admit`, unless `before` admitted this very frame already."""
        if frame is not self._admitted:
            self.admit(frame)
        self._admitted = None

    def _check_need(self, rec: pb.Record, need: int) -> None:
        if self.budget is not None and need > self.budget.limit:
            self.refused_seq = rec.header.seq
            raise WireError(
                f"record {rec.header.seq}: checking it needs about {need / MiB:.0f} MiB of server memory "
                f"({len(rec.tensors)} tensors, {rec.payload_bytes / MiB:.1f} MiB; the bench and same-dtype runs cost "
                f"a multiple of each tensor's bytes, docs/security.md), more than this server's memory budget of "
                f"{self.budget.limit / MiB:.0f} MiB (gpu-server --memory-mb): raise it on the server, or capture fewer "
                f"or smaller tensors with tensor.list / tensor.scope")

    def before(self, frame: pb.Frame, data: bytes | memoryview | None = None) -> int:
        """The bytes to reserve (and then `granted`) before `feed`ing this frame: the rest of its record's peak when
        the frame completes it, else 0. Raises WireError for a header that is refused (nothing is held for it)."""
        body = frame.WhichOneof("body")
        if data is None:
            data = frame.data
        if body == "record":
            rec = frame.record
            self._admitted = None
            self.admit(frame)
            single = len(data) == rec.payload_bytes
            need = check_peak(rec, self.loose + rec.payload_bytes - len(data))
            self._check_need(rec, need)
            self._admitted = frame
            return max(0, need - self.loose) if single and self.budget is not None else 0
        if body == "chunk" and self.completes(frame, data) and self.budget is not None:
            return max(0, self.need - self.held - len(data))
        return 0

    def completes(self, frame: pb.Frame, data: bytes | memoryview | None = None) -> bool:
        """True when this chunk frame would complete the record being assembled (the caller may join off-loop).
        `data`: the frame's data where the caller parsed it apart (protos.framing.parse_frame); else frame.data."""
        return (self.record is not None and frame.WhichOneof("body") == "chunk"
                and frame.chunk.seq == self.record.header.seq
                and self.filled + len(frame.data if data is None else data) == self.record.payload_bytes)

    def feed(self, frame: pb.Frame, data: bytes | memoryview | None = None
             ) -> tuple[pb.Record, bytes | memoryview] | None:
        """The complete record and its payload once `frame` completes one, else None (`take_reserved` then gives
        the budget bytes it holds). `data` as for `completes`; a payload that came in one frame is that frame's data
        as it is (a view into the message: no copy)."""
        body = frame.WhichOneof("body")
        if data is None:
            data = frame.data
        if body == "record":
            rec = frame.record
            self._admit_once(frame)
            self._keep()
            if len(data) == rec.payload_bytes:
                # The whole payload rode on this frame (records up to one chunk: the common case): use its bytes
                # as they are, without a second copy. Decoded tensors are read-only views; replay copies them.
                self._hand_over()
                return rec, data
            # The chunks are written into one buffer as they arrive (each byte is copied once more only); its pages
            # are taken as they are written, so a header announcing much and sending little holds little. The
            # first frame's data stays where it is until the next chunk comes (no copy for a record that stalls).
            self.record, self.filled = rec, len(data)
            self._first = data
            self.need = check_peak(rec, self.held + rec.payload_bytes - len(data))
            self.started = self.last = time.monotonic()
            self.waited = self._waited_at_last = self.share_waited = 0.0
            if self.share is not None:
                self.share.started(id(self), self.started)
            return None
        elif body == "chunk":
            if self.record is None and frame.chunk.seq == self.refused_seq:
                return None   # the rest of a refused record: it was answered once
            if self.record is None or frame.chunk.seq != self.record.header.seq:
                raise WireError(f"chunk of record {frame.chunk.seq} without its record header")
            offset = frame.chunk.offset
            self.last = time.monotonic()
            self._waited_at_last = self.waited
        else:
            raise WireError(f"unexpected {body or 'empty'} frame inside a record")
        assert self.record is not None
        expected = self.record.payload_bytes
        if offset != self.filled or offset + len(data) > expected:
            rec = self.record
            self.reset()
            raise WireError(f"record {rec.header.seq}: chunk at offset {offset} (+{len(data)} bytes) does not continue "
                            f"the payload at {self.filled} of {rec.payload_bytes}")
        self._keep(len(data))   # the rest of the message (its framing) is given back once it is handled
        if self.payload is None:
            self.payload = mmap.mmap(-1, expected)
            self.payload[:len(self._first)] = self._first
            self._first = b""
        self.payload[offset:offset + len(data)] = data
        self.filled += len(data)
        if self.filled == expected:
            out = (self.record, memoryview(self.payload))
            self.record, self.payload, self.filled = None, None, 0
            if self.share is not None:
                self.share.ended(id(self))
            self._hand_over()
            return out
        return None

    def _hand_over(self) -> None:
        self.reserved += self.held + self.extra
        self._reserved_recv += self._held_recv
        self.held = self._held_recv = self.extra = 0
        self.need = 0

    def take_reserved(self) -> int:
        """The budget bytes of the record `feed` just returned: the caller releases them (via the intake, or the
        workers once it is checked). Its connection no longer holds it."""
        n, self.reserved = self.reserved, 0
        if self.share is not None and self._reserved_recv:
            self.share.release(self._reserved_recv)
        self._reserved_recv = 0
        return n

    def batch(self, frame: pb.Frame, data: bytes | memoryview) -> list[tuple[pb.Record, bytes | memoryview, int, str]]:
        """The records of a Batch frame, each as (record, payload view, its peak, '') or (record, view, 0, why it
        is refused). Raises WireError (nothing more is held) when the frame breaks the contract. Reserve the sum of
        the peaks, `granted` it, then `unbatch`."""
        out = []
        for rec, payload in split_batch(frame, self.limits, data):
            need = check_peak(rec, len(payload) + rec.ByteSize())
            try:
                self._check_need(rec, need)
            except WireError as exc:
                out.append((rec, payload, 0, str(exc)))
                continue
            out.append((rec, payload, need, ""))
        self.refused_seq = None
        return out

    def unbatch(self, parts: list[tuple[pb.Record, bytes | memoryview, int, str]]
                ) -> list[tuple[pb.Record, bytes, int, str]]:
        """Each record of a batch with its own copy of its payload and its peak reserved; the message (its bytes
        were granted beforehand as the sum of the peaks) is given back, so no record keeps the others' bytes."""
        out = [(rec, bytes(payload) if not why else b"", need, why) for rec, payload, need, why in parts]
        self.extra = 0      # the records' peaks go with them
        self.drop_loose()   # the message itself
        return out

    # -- time ----------------------------------------------------------------------------------------------------
    def pause(self) -> None:
        """The stream waits for the server's memory budget: not the client's fault, not counted against its rate."""
        if self.record is not None and self._wait_since is None:
            self._wait_since = time.monotonic()

    def resume(self) -> None:
        if self._wait_since is not None:
            self.waited += time.monotonic() - self._wait_since
            self._wait_since = None

    def _deadlines(self) -> dict[str, float]:
        lim = self.limits
        assert self.record is not None
        out = {"stall": self.last + lim.record_timeout_s + (self.waited - self._waited_at_last),
               "cap": self.started + lim.record_max_s}
        if lim.min_record_rate > 0:
            out["rate"] = self.started + self.waited + lim.record_timeout_s + self.filled / lim.min_record_rate
        return out

    def deadline(self) -> float | None:
        """Monotonic time by which the record being assembled must get its next frame; None when none is."""
        return None if self.record is None else min(self._deadlines().values())

    def cap_deadline(self) -> float | None:
        """When the record being assembled will have been half received for `Limits.record_max_s`."""
        return None if self.record is None else self.started + self.limits.record_max_s

    def late(self, now: float | None = None) -> str:
        """Why the record being assembled is cut now (its earliest deadline that passed), in words."""
        rec = self.record
        if rec is None:
            return "no record was being received"
        now = time.monotonic() if now is None else now
        passed = {k: v for k, v in self._deadlines().items() if v <= now + 0.05}
        which = min(passed, key=passed.__getitem__) if passed else "stall"
        lim = self.limits
        head = f"record {rec.header.seq}: {self.filled} of {rec.payload_bytes} payload bytes arrived"
        elapsed = now - self.started
        share = ""
        if self.share is not None and self.share_waited >= 0.05:
            share = (f"; for {self.share_waited:.1f} s of it its connection held its limit of "
                     f"{self.share.limit / MiB:g} MiB in records it had not finished sending, so none of its streams "
                     f"was read (gpu-server --connection-memory-mb {self.share.limit / MiB:g})")
        if which == "cap":
            waited = f"; the server's memory budget was full for {self.waited:.0f} s of it" if self.waited >= 1 else ""
            return (f"{head} in {elapsed:.0f} s, the longest a record may stay half received (gpu-server "
                    f"--record-max-s {lim.record_max_s:g}){waited}{share}")
        if which == "rate":
            active = max(elapsed - self.waited, 1e-9)
            return (f"{head} in {active:.1f} s ({self.filled / active / MiB:.3g} MiB/s), slower than the minimum of "
                    f"{lim.min_record_rate / MiB:g} MiB/s after the first {lim.record_timeout_s:g} s (gpu-server "
                    f"--min-record-rate-mb){share}")
        return f"{head}, then nothing for {lim.record_timeout_s:g} s (gpu-server --record-timeout-s){share}"

    def reset(self) -> None:
        """Drop the record being assembled and give back what it held."""
        if self.payload is not None:
            self.payload.close()
        self._first = b""
        self._admitted = None
        if self.record is not None and self.share is not None:
            self.share.ended(id(self))
        self.record, self.payload, self.filled = None, None, 0
        self._give(self.held + self.extra, self._held_recv)
        self.held = self._held_recv = self.extra = 0
        self.need = 0
        self._wait_since = None

    def close(self) -> None:
        """The stream ended: give back everything it still holds."""
        self.reset()
        self.drop_loose()
        self._give(self.reserved, self._reserved_recv)
        self.reserved = self._reserved_recv = 0


MAX_ORIGINS = 16   # connections (or certificates) remembered per run and rank as having sent its records


class Intake:
    def __init__(self, config: ServerConfig, dispatch: Callable[..., None], limits: Limits = DEFAULT_LIMITS,
                 on_end: Callable[[pb.End], None] | None = None, *, spool: Spool | None = None,
                 budget: ByteBudget | None = None, world_size: int | None = None,
                 not_reported: Callable[[str, int, int], None] = lambda run_id, rank, seq: None):
        self.config = config
        self.dispatch = dispatch
        # a spooled record this server reports nothing for: PendingCalls decides its journal line
        # (gpu_server/pending.py, through WorkerPool.not_reported)
        self.not_reported = not_reported
        self.limits = limits
        self.on_end = on_end or (lambda end: None)
        self.spool = spool
        self.budget = budget
        self.world_size = world_size   # --world-size: ranks at or above it are refused
        self._seen: dict[tuple[str, int], SeqSet] = {}
        # who sent each (run, rank)'s records: the connection, or under mutual TLS the client certificate (the
        # transport's `origin`); an end message counts only from one of them. Restored from the spool: nobody.
        self._origins: dict[tuple[str, int], list[str]] = {}
        self._live: dict[str, int] = {}   # origins with a stream open now (gRPC): their ranks are still running
        # (ticket, bytes) the spool holds until the ticket is ready
        self._holds: queue.SimpleQueue[tuple[Ticket, int]] | None = None
        self._lock = threading.Lock()
        self.on_closed: Callable[[], None] = lambda: None   # an origin's last stream closed (ServerApp: done yet?)
        self.received = 0
        self.duplicates = 0
        self.rejected = 0          # records that break the wire contract (malformed, hostile, refused sizes or names)
        self.not_replayable = 0    # valid records that cannot be replayed here (their SKIP row says why)
        self.filtered = 0
        self.refused_ranks = 0

    def mark_seen(self, run_id: str, rank: int, seq: int, origin: str = "", restored: bool = True) -> bool | None:
        """True if new, False for a duplicate. The durable spool replays this on restart so duplicates are caught
        across restarts. None (not marked) for the first record of a new (run, rank) beyond `Limits.max_run_ranks`,
        unless `restored` (the spool's, at start)."""
        key = (run_id, rank)
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                if not restored and len(self._seen) >= self.limits.max_run_ranks:
                    return None
                seen = self._seen[key] = SeqSet()
            if origin:
                origins = self._origins.setdefault(key, [])
                if origin not in origins:
                    origins.append(origin)
                    del origins[:-MAX_ORIGINS]
            if seq in seen:
                return False
            seen.add(seq)
            return True

    # -- who is connected (gRPC) ---------------------------------------------------------------------------------
    def origin_opened(self, origin: str) -> None:
        with self._lock:
            self._live[origin] = self._live.get(origin, 0) + 1

    def origin_closed(self, origin: str) -> None:
        with self._lock:
            left = self._live.get(origin, 0) - 1
            if left > 0:
                self._live[origin] = left
            else:
                self._live.pop(origin, None)
        if left <= 0:
            self.on_closed()

    def adopt(self, run_id: str, rank: int, origin: str) -> None:
        """A stream says (Hello) it carries this run and rank: when none of the connections that sent its records is
        open any more (the agent reconnected after its last record was acknowledged), its end may come from this
        one. A record's sender cannot be taken over while it is connected."""
        key = (run_id, rank)
        with self._lock:
            origins = self._origins.get(key)
            if origins and origin not in origins and not any(o in self._live for o in origins):
                origins.append(origin)
                del origins[:-MAX_ORIGINS]

    def connected_keys(self) -> list[tuple[str, int]]:
        """The (run, rank) pairs whose records came over a connection (or certificate) that is still open."""
        with self._lock:
            return [key for key, origins in self._origins.items() if any(o in self._live for o in origins)]

    def rank_refusal(self, rank: int) -> str:
        """Why records and ends of this rank are refused ('' when they are not): at or above --world-size."""
        if self.world_size is not None and rank >= self.world_size:
            return (f"rank {rank} is not below the world size {self.world_size} this server was started with "
                    "(gpu-server --world-size)")
        return ""

    def accept(self, record: pb.Record, payload: bytes | bytearray | memoryview,
               reserved: int = 0, origin: str = "") -> tuple[int, str]:
        """Take one complete record; returns its acknowledgement once the record is durable."""
        return self.submit(record, payload, reserved, origin).wait()

    def submit(self, record: pb.Record, payload: bytes | bytearray | memoryview, reserved: int = 0,
               origin: str = "") -> Ticket:
        """Take one complete record; the returned ticket holds the acknowledgement once the record is durable.

        The record is validated completely (header, name, tensor table, every value decoded) before it is spooled:
        a record that would fail to decode is answered REJECTED at once with the reason, gets its SKIP row, and is
        never spooled (so a restart never meets it). `reserved`: bytes of `self.budget` the record holds (its
        estimated peak, `check_peak`: released here, or by the workers once they checked it). `origin`: the
        connection or certificate it came over (`end_backed`). A rank at or above --world-size, or a (run, rank)
        beyond --max-run-ranks, is answered REJECTED and never reported (no report files for it).
        """
        from gpu_server.spool import Ticket

        h = record.header
        self.received += 1
        if not RUN_ID.match(h.run_id):
            self.rejected += 1
            self._release(reserved)
            return Ticket(h.seq, REJECTED, f"record {h.seq}: run id '{log_text(h.run_id)}' is not 1-64 letters, "
                                           "digits, '-' or '_'")
        why = self.rank_refusal(h.rank)
        if why:
            self.rejected += 1
            self.refused_ranks += 1
            self._release(reserved)
            return Ticket(h.seq, REJECTED, f"record {h.seq}: {why}")
        new = self.mark_seen(h.run_id, h.rank, h.seq, origin, restored=False)
        if new is None:
            self.rejected += 1
            self.refused_ranks += 1
            self._release(reserved)
            return Ticket(h.seq, REJECTED, f"record {h.seq}: this server already holds the records of "
                                           f"{self.limits.max_run_ranks} (run, rank) pairs, its limit (gpu-server "
                                           f"--max-run-ranks); run '{log_text(h.run_id)}' rank {h.rank} is refused: "
                                           "raise the limit, or use a new server and --out for a new training")
        if not new:
            self.duplicates += 1
            self._release(reserved)
            earlier = self.spool.pending((h.run_id, h.rank, h.seq)) if self.spool is not None else None
            # The first copy may not be durable yet: answer once it is.
            return Ticket(h.seq, DUPLICATE, after=earlier if earlier is not None and not earlier.ready() else None)
        status, reason, job = self._classify(record, payload, reserved)
        if job is None:
            return Ticket(h.seq, status, reason)
        ticket = self.spool.append(record, payload) if self.spool is not None else None
        if ticket is not None and self.budget is not None and reserved:
            self._spool_hold(ticket, len(payload))
        self.dispatch(job)
        return ticket if ticket is not None else Ticket(h.seq, ACCEPTED)

    def _classify(self, record: pb.Record, payload: bytes | bytearray | memoryview,
                  reserved: int) -> tuple[int, str, Job | None]:
        """The rank and API filters, then `validate`, once per record (its call name checked once): (ACCEPTED, '',
        job) for a record to check (holding `reserved`); (ACCEPTED, '', None) for one the filters leave out (counted
        `filtered`), (REJECTED, why, None) once its SKIP row is dispatched: `reserved` released."""
        h = record.header
        match = valid_call_name(h.name)
        if match is not None and (not self.config.wants_rank(h.rank) or not self.config.wants(match.group(2))):
            self.filtered += 1
            self._release(reserved)
            return ACCEPTED, "", None
        job, reason = self.validate(record, payload, match)
        if reason:
            self._reject_row(h, h.name if match else f"invalid.record.{h.seq}", match, reason, job, reserved)
            return REJECTED, reason, None
        assert job is not None
        job.reserved = reserved
        return ACCEPTED, "", job

    def validate(self, record: pb.Record, payload: bytes | bytearray | memoryview,
                 match: re.Match[str] | None) -> tuple[Job | None, str]:
        """(the decoded job, "") for a valid record; else (the job when it decoded, or None, why it is rejected).
        `match`: `valid_call_name` of its name.

        Never raises: a record that breaks the decoder in a way the wire checks did not foresee is rejected too.
        """
        h = record.header
        if match is None:
            self.rejected += 1
            return None, f"record {h.seq}: API name '{log_text(h.name)}' is not Category.api.n with a known category"
        if h.direction not in (pb.FORWARD, pb.BACKWARD):
            self.rejected += 1
            return None, f"{h.name}: direction {h.direction} is neither forward nor backward"
        try:
            job = decode_job(record, payload, self.limits, self._max_ranks(), match)
        except CollectiveError as exc:
            self.rejected += 1
            return None, f"{h.name}: malformed collective: {exc}"
        except WireError as exc:
            self.rejected += 1
            return None, f"{h.name}: malformed record: {exc}"
        except Exception as exc:  # noqa: BLE001 - a decoder bug must cost one record, never the stream or a restart
            self.rejected += 1
            log.error("%s (run %s rank %d seq %d): the decoder failed (%s: %s); the record is rejected", h.name,
                      log_text(h.run_id), h.rank, h.seq, type(exc).__name__, log_text(str(exc), 200))
            return None, f"{h.name}: the record cannot be decoded ({type(exc).__name__})"
        if job.collective is not None:
            # checked across ranks, never replayed (gpu_server/collectives.py): every member must be a rank this
            # server takes records of
            outside = [r for r in job.collective.ranks if self.rank_refusal(r)]
            if outside:
                self.rejected += 1
                return job, (f"{h.name}: malformed collective: member rank {outside[0]} is not below the world size "
                             f"{self.world_size} this server was started with (gpu-server --world-size)")
            return job, ""
        if not job.skip_reason:
            why = replayable(match.group(1), match.group(2), job.args, job.kwargs)
            if why is not None:
                # a name the agent never sends without its reason breaks the contract (rejected); a valid record
                # whose arguments (or this host) keep it from being replayed is `not replayable`: its SKIP row says why
                if name_refused(match.group(1), match.group(2)):
                    self.rejected += 1
                else:
                    self.not_replayable += 1
                return job, f"{h.name}: {why}"
        return job, ""

    def process(self, record: pb.Record, payload: bytes | bytearray | memoryview,
                reserved: int = 0) -> tuple[int, str]:
        """Validate a record replayed from the spool and hand its job (or SKIP row) to the workers.

        A spooled record that no longer validates is quarantined: a SKIP row, never fatal.
        """
        status, reason, job = self._classify(record, payload, reserved)
        if job is not None:
            self.dispatch(job)
        elif status == ACCEPTED:   # filtered (spooled under an earlier config that wanted it)
            self.not_reported(record.header.run_id, record.header.rank, record.header.seq)
        return status, reason

    def _max_ranks(self) -> int:
        """The most member ranks a collective may name: --world-size when given, else --max-run-ranks."""
        return min(self.world_size, self.limits.max_run_ranks) if self.world_size else self.limits.max_run_ranks

    def end_backed(self, end: pb.End, origin: str = "") -> str:
        """'' when this end message may count; else why not, in words.

        It counts when its run and rank sent records to this server and, for records that came over gRPC, when it
        comes over a connection (or, under mutual TLS, with a certificate) that sent them. Any other end is
        acknowledged but not counted: it must not end a rank nor make `--exit-when-done` stop the server. A
        (run, rank) known only from the spool (records accepted before a restart) is ended by any end for it."""
        why = self.rank_refusal(end.rank)
        if why:
            return f"{why}; the end message is not counted"
        key = (end.run_id, end.rank)
        with self._lock:
            if not self._seen.get(key):
                return (f"no record of run '{log_text(end.run_id)}' rank {end.rank} reached this server; the end "
                        "message is not counted")
            origins = self._origins.get(key)
            if not origins or origin in origins:
                return ""
        return (f"the records of run '{log_text(end.run_id)}' rank {end.rank} came over another connection (or "
                "client certificate); the end message is not counted")

    def _release(self, n: int) -> None:
        if self.budget is not None and n:
            self.budget.release(n)

    def _spool_hold(self, ticket: Ticket, n: int) -> None:
        """The spool keeps a record's payload until its segment is written, which may be after the workers have
        checked it (and released its reservation): those bytes are counted again until the ticket is ready (one
        thread waits for the tickets in order; the spool writes them in order)."""
        assert self.budget is not None
        self.budget.force(n)
        with self._lock:
            if self._holds is None:
                self._holds = queue.SimpleQueue()
                threading.Thread(target=self._release_holds, name="gpu-server-spool-holds", daemon=True).start()
            self._holds.put((ticket, n))

    def _release_holds(self) -> None:
        assert self._holds is not None and self.budget is not None
        while True:
            ticket, n = self._holds.get()
            while not ticket.ready():
                ticket.wait(1.0)
            self.budget.release(n)

    def _reject_row(self, h: pb.RecordHeader, name: str, match: re.Match[str] | None, reason: str, job: Job | None,
                    reserved: int) -> None:
        """Dispatch the SKIP row of a rejected record (`match`: `valid_call_name(name)`)."""
        self._release(reserved)
        if not self.config.wants_rank(h.rank):
            self.not_reported(h.run_id, h.rank, h.seq)
            return
        category, api = (match.group(1), match.group(2)) if match else ("", "")
        job = job or Job(run_id=h.run_id if RUN_ID.match(h.run_id) else "invalid", rank=h.rank, step=h.step,
                         seq=h.seq, name=name, category=category, api=api, direction=h.direction or pb.FORWARD,
                         module=wire_text(h.module), source=wire_text(h.source))
        job.skip_reason = reason
        job.backward_expected = False
        job.collective = None   # a rejected collective is never matched: its SKIP row says why
        job.reserved = 0
        self.dispatch(job)


def is_collective(record: pb.Record, category: str, api: str) -> bool:
    """A torch.distributed call the server checks across ranks: `Distributed.<api>` with api in COLLECTIVES or
    POINT_TO_POINT and a Collective field. Any other Distributed record keeps its SKIP row."""
    return (category == "Distributed" and (api in COLLECTIVES or api in POINT_TO_POINT)
            and record.HasField("collective"))


def decode_job(record: pb.Record, payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
               max_ranks: int | None = None, match: re.Match[str] | None = None) -> Job:
    """The record's Job; a collective's Collective field validated into `Job.collective` (raises CollectiveError,
    member ranks at most `max_ranks`, default `limits.max_run_ranks`). `match`: `valid_call_name` of its name, where
    the caller has it."""
    h = record.header
    match = match or valid_call_name(h.name)
    dec = RecordDecoder(record, payload, limits)
    requires_grad: set[int] = set()

    def value(v):
        return dec.value(v)

    args = tuple(value(v) for v in record.args.items)
    kwargs = dec.mapping(record.kwargs)
    for i, meta in enumerate(record.tensors):
        if meta.requires_grad:
            requires_grad.add(id(dec.tensor(i)))
    job = Job(
        run_id=h.run_id, rank=h.rank, step=h.step, seq=h.seq, name=h.name, category=match.group(1),
        api=match.group(2), direction=h.direction, args=args, kwargs=kwargs,
        output=value(record.output) if record.HasField("output") else None,
        grad_output=value(record.grad_output) if record.HasField("grad_output") else None,
        grad_input=value(record.grad_input) if record.HasField("grad_input") else None,
        grad_input_positions=tuple(record.grad_input_positions), requires_grad=frozenset(requires_grad),
        grad_enabled=record.grad_enabled,
        autocast=(record.autocast.enabled, record.autocast.dtype, record.autocast.device_type),
        inplace=record.inplace, backward_expected=record.backward_expected, skip_reason=record.skip_reason[:1000],
        intra_op_threads=min(record.intra_op_threads, 1024),
        nbytes=len(payload), module=wire_text(h.module), source=wire_text(h.source), wire=(record, payload),
    )
    if record.HasField("random"):
        r = record.random
        job.rng_state, job.rng_device = r.generator_state, r.device_type[:32]
        if r.has_mask:
            mask = dec.tensor(r.mask)
            if mask.dtype != torch.bool:
                raise WireError(f"dropout mask has dtype {mask.dtype}, expected bool")
            job.mask = mask
    if is_collective(record, job.category, job.api):
        job.collective = from_wire(record.collective, job.api, int(h.rank),
                                   limits.max_run_ranks if max_ranks is None else max_ranks)
    return job

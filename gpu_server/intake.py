"""Accepting records, whatever transport brought them (docs/security.md, "Who can reach the port or the folder").

`FrameAssembler` joins one stream's frames into (Record, payload), reserving the payload's bytes from the server's
memory budget first (`ByteBudget`, after `admit` refused a record above `Limits.max_record_bytes`). `Intake.submit`
drops duplicates (same run, rank, seq), applies the rank and API filters, validates the whole record (header, strict
names, tensor table, every value decoded, the replay registry) and only then writes it to the durable spool
(gpu_server/spool.py) and hands the decoded `Job` to the workers; it returns a `Ticket` that holds the
acknowledgement once the record is durable. A record that fails validation is answered REJECTED at once with the
reason and a SKIP row, and is never spooled. `Intake.accept` is the same, waiting for the ticket. `Intake.end_backed`
says whether an end message may count (its run and rank sent records).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from gpu_server.config import ServerConfig
from gpu_server.registry import replayable
from gpu_server.seqset import SeqSet
from protos import online_check_pb2 as pb
from protos.codec import RecordDecoder, WireError
from protos.limits import DEFAULT_LIMITS, RUN_ID, Limits, MiB, log_text, valid_call_name

log = logging.getLogger("gpu_server")

if TYPE_CHECKING:
    from gpu_server.spool import Spool, Ticket

ACCEPTED, DUPLICATE, REJECTED = pb.Ack.ACCEPTED, pb.Ack.DUPLICATE, pb.Ack.REJECTED


@dataclasses.dataclass
class Job:
    run_id: str
    rank: int
    step: int
    seq: int
    name: str                  # Functional.linear.0
    category: str
    api: str
    direction: int
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    output: Any = None
    grad_output: Any = None
    grad_input: Any = None
    grad_input_positions: tuple[int, ...] = ()
    requires_grad: frozenset[int] = frozenset()   # ids of decoded input tensors that required grad
    grad_enabled: bool = False
    autocast: tuple[bool, str, str] = (False, "", "")
    inplace: bool = False
    backward_expected: bool = False
    rng_state: bytes = b""
    rng_device: str = ""
    mask: torch.Tensor | None = None
    skip_reason: str = ""      # set: the call is reported SKIP with this reason
    intra_op_threads: int = 0  # CPU training's thread count (0: unknown / not a CPU device)
    nbytes: int = 0
    reserved: int = 0          # bytes of the server's memory budget this job holds until it is checked
    module: str = ""           # where the call was made (the header's, through wire_text): "TinyLM.blocks.0.attn"
    source: str = ""           # "train.py:42 (forward)"
    wire: tuple[Any, Any] | None = None   # (pb.Record, payload) it was decoded from: a replay worker process decodes
                                          # the same bytes again (gpu_server/sandbox.py)


MAX_WHERE = 1024   # characters kept of a record's module path and source location


def wire_text(value: str, limit: int = MAX_WHERE) -> str:
    """A free-text header field (module, source) as the reports keep it: as sent when short and printable, else cut
    to `limit` characters and escaped (protos.limits.log_text). Never a reason to reject the record."""
    if len(value) <= limit and value.isprintable():
        return value
    return log_text(value, limit)


class ByteBudget:
    """Bytes of record payloads the server holds at once (assembling, spooling, queued for the workers).

    Waiters (threads with `acquire`, event-loop coroutines with `acquire_async`) are granted in arrival order as
    soon as their bytes fit; a later, smaller request may pass one that does not fit yet, unless that one has waited
    longer than `AGING_S` (then everything queues behind it, so a large record is never starved). A request larger
    than the whole budget is let through alone (only a restart with a smaller `--memory-mb` meets one: the
    transports refuse records above `--max-record-mb`, which is at most the budget).
    """

    AGING_S = 1.0

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._waiters: collections.deque[_Waiter] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.held + n <= self.limit or not self.held

    def _take(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def _enter(self, waiter: _Waiter) -> bool:
        """Under the lock: take the bytes now (True) or queue the waiter."""
        if self._fits(waiter.n) and (not self._waiters or waiter.since - self._waiters[0].since <= self.AGING_S):
            self._take(waiter.n)
            return True
        self._waiters.append(waiter)
        return False

    def _leave(self, waiter: _Waiter) -> bool:
        """Under the lock: withdraw a waiter that gives up; True when it was granted meanwhile."""
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return waiter.granted
        self._grant_locked()
        return False

    def acquire(self, n: int, cancelled: Callable[[], bool] = lambda: False) -> bool:
        waiter = _Waiter(n, event=threading.Event())
        with self._lock:
            if self._enter(waiter):
                return True
        while not waiter.event.wait(0.5):
            if cancelled():
                with self._lock:
                    if not self._leave(waiter):
                        return False
                return True
        return True

    async def acquire_async(self, n: int) -> None:
        """Wait (without holding a thread) until `n` bytes are granted. Cancelling the wait gives nothing back
        that was not granted, and gives back what was."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(n, future=loop.create_future(), loop=loop)
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
            if self._fits(waiter.n):
                self._waiters.remove(waiter)
                self._take(waiter.n)
                waiter.grant()
            elif now - waiter.since > self.AGING_S:
                break   # it waited long enough: nobody passes it any more


class _Waiter:
    __slots__ = ("n", "event", "future", "loop", "since", "granted")

    def __init__(self, n: int, event: threading.Event | None = None, future=None, loop=None):
        self.n, self.event, self.future, self.loop = n, event, future, loop
        self.since = time.monotonic()
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


class FrameAssembler:
    """One stream's frames -> complete records. Frames of one record are contiguous and in offset order.

    The payload's bytes are reserved from the memory budget once the record header is admitted (`admit`, then
    `feed(frame, reserved=n)` when the caller waited for the bytes itself; or `feed` alone, which waits here). The
    chunks of a record that was refused are dropped without an answer each (the record got one REJECTED).
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS, budget: ByteBudget | None = None,
                 cancelled: Callable[[], bool] = lambda: False):
        self.limits = limits
        self.budget = budget
        self.cancelled = cancelled
        self.record: pb.Record | None = None
        self.payload: list[bytes | memoryview] | None = None   # the chunks of a multi-frame record
        self.filled = 0
        self.reserved = 0          # budget bytes held by the record being assembled (handed over when complete)
        self.started = 0.0         # monotonic time the record being assembled was admitted
        self.last = 0.0            # ... and its latest frame arrived
        self.refused_seq: int | None = None  # chunks of this record are dropped silently

    def admit(self, frame: pb.Frame) -> int:
        """Check a record header before anything is reserved for it: the payload bytes to reserve."""
        if self.record is not None:
            seq, filled = self.record.header.seq, self.filled
            self.reset()
            raise WireError(f"record {seq} was cut off by the next record after {filled} bytes")
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

    def completes(self, frame: pb.Frame, data: bytes | memoryview | None = None) -> bool:
        """True when this chunk frame would complete the record being assembled (the caller may join off-loop).
        `data`: the frame's data where the caller parsed it apart (protos.framing.parse_frame); else frame.data."""
        return (self.record is not None and frame.WhichOneof("body") == "chunk"
                and self.filled + len(frame.data if data is None else data) == self.record.payload_bytes)

    def deadline(self) -> float | None:
        """Monotonic time by which the record being assembled must get its next frame; None when none is."""
        if self.record is None:
            return None
        timeout = self.limits.record_timeout_s
        return min(self.last + timeout, self.started + timeout + self.record.payload_bytes / MiB)

    def feed(self, frame: pb.Frame, reserved: int | None = None, data: bytes | memoryview | None = None
             ) -> tuple[pb.Record, bytes | memoryview] | None:
        """The complete record and its payload once `frame` completes one, else None. `data` as for `completes`;
        a payload that came in one frame is that frame's data as it is (a view into the message: no copy)."""
        body = frame.WhichOneof("body")
        if data is None:
            data = frame.data
        if body == "record":
            if reserved is None:
                n = self.admit(frame)
                if self.budget is not None and not self.budget.acquire(n, self.cancelled):
                    raise WireError(f"record {frame.record.header.seq}: the stream closed while waiting for server "
                                    "memory")
                reserved = n if self.budget is not None else 0
            self.reserved = reserved
            rec = frame.record
            if len(data) == rec.payload_bytes:
                # The whole payload rode on this frame (records up to one chunk: the common case): use its bytes
                # as they are, without a second copy. Decoded tensors are read-only views; replay copies them.
                self.record, self.payload, self.filled = None, None, 0
                return rec, data
            # The chunks are kept as they arrive and joined once, at the end: a header alone, whatever it
            # announces, costs nothing, and each byte is copied once more only.
            self.record, self.filled, self.payload = rec, 0, []
            self.started = self.last = time.monotonic()
            offset = 0
        elif body == "chunk":
            if self.record is None and frame.chunk.seq == self.refused_seq:
                return None   # the rest of a refused record: it was answered once
            if self.record is None or frame.chunk.seq != self.record.header.seq:
                raise WireError(f"chunk of record {frame.chunk.seq} without its record header")
            offset = frame.chunk.offset
            self.last = time.monotonic()
        else:
            raise WireError(f"unexpected {body or 'empty'} frame inside a record")
        expected = self.record.payload_bytes
        if offset != self.filled or offset + len(data) > expected:
            rec = self.record
            self.reset()
            raise WireError(f"record {rec.header.seq}: chunk at offset {offset} (+{len(data)} bytes) does not continue "
                            f"the payload at {self.filled} of {rec.payload_bytes}")
        self.payload.append(data)
        self.filled += len(data)
        if self.filled == expected:
            try:
                out = (self.record, b"".join(self.payload))
            except MemoryError:
                seq = self.record.header.seq
                self.reset()
                raise WireError(f"record {seq}: no memory for {expected} payload bytes") from None
            self.record, self.payload, self.filled = None, None, 0
            return out
        return None

    def take_reserved(self) -> int:
        """The budget bytes of the record `feed` just returned: the caller releases them (via the intake)."""
        n, self.reserved = self.reserved, 0
        return n

    def reset(self) -> None:
        self.record, self.payload, self.filled = None, None, 0
        if self.budget is not None and self.reserved:
            self.budget.release(self.reserved)
        self.reserved = 0


class Intake:
    def __init__(self, config: ServerConfig, dispatch: Callable[..., None], limits: Limits = DEFAULT_LIMITS,
                 on_end: Callable[[pb.End], None] | None = None, *, spool: Spool | None = None,
                 budget: ByteBudget | None = None):
        self.config = config
        self.dispatch = dispatch
        self.limits = limits
        self.on_end = on_end or (lambda end: None)
        self.spool = spool
        self.budget = budget
        self._seen: dict[tuple[str, int], SeqSet] = {}
        self._lock = threading.Lock()
        self.received = 0
        self.duplicates = 0
        self.rejected = 0
        self.filtered = 0

    def mark_seen(self, run_id: str, rank: int, seq: int) -> bool:
        """True if new. The durable spool replays this on restart so duplicates are caught across restarts."""
        with self._lock:
            seen = self._seen.setdefault((run_id, rank), SeqSet())
            if seq in seen:
                return False
            seen.add(seq)
            return True

    def accept(self, record: pb.Record, payload: bytes | bytearray | memoryview,
               reserved: int = 0) -> tuple[int, str]:
        """Take one complete record; returns its acknowledgement once the record is durable."""
        return self.submit(record, payload, reserved).wait()

    def submit(self, record: pb.Record, payload: bytes | bytearray | memoryview, reserved: int = 0) -> Ticket:
        """Take one complete record; the returned ticket holds the acknowledgement once the record is durable.

        The record is validated completely (header, name, tensor table, every value decoded) before it is spooled:
        a record that would fail to decode is answered REJECTED at once with the reason, gets its SKIP row, and is
        never spooled (so a restart never meets it). `reserved`: bytes of `self.budget` the payload holds
        (released here or once the workers checked it).
        """
        from gpu_server.spool import Ticket

        h = record.header
        self.received += 1
        if not RUN_ID.match(h.run_id):
            self.rejected += 1
            self._release(reserved)
            return Ticket(h.seq, REJECTED, f"record {h.seq}: run id '{log_text(h.run_id)}' is not 1-64 letters, "
                                           "digits, '-' or '_'")
        if not self.mark_seen(h.run_id, h.rank, h.seq):
            self.duplicates += 1
            self._release(reserved)
            earlier = self.spool.pending((h.run_id, h.rank, h.seq)) if self.spool is not None else None
            # The first copy may not be durable yet: answer once it is.
            return Ticket(h.seq, DUPLICATE, after=earlier if earlier is not None and not earlier.ready() else None)
        match = valid_call_name(h.name)
        if match is not None and (not self.config.wants_rank(h.rank) or not self.config.wants(match.group(2))):
            self.filtered += 1
            self._release(reserved)
            return Ticket(h.seq, ACCEPTED)
        job, reason = self.validate(record, payload)
        if reason:
            self._reject_row(h, h.name if match else f"invalid.record.{h.seq}", reason, job, reserved=reserved)
            return Ticket(h.seq, REJECTED, reason)
        ticket = self.spool.append(record, payload) if self.spool is not None else None
        job.reserved = reserved
        self.dispatch(job)
        return ticket if ticket is not None else Ticket(h.seq, ACCEPTED)

    def validate(self, record: pb.Record, payload: bytes | bytearray | memoryview) -> tuple[Job | None, str]:
        """(the decoded job, "") for a valid record; else (the job when it decoded, or None, why it is rejected).

        Never raises: a record that breaks the decoder in a way the wire checks did not foresee is rejected too.
        """
        h = record.header
        match = valid_call_name(h.name)
        if match is None:
            self.rejected += 1
            return None, f"record {h.seq}: API name '{log_text(h.name)}' is not Category.api.n with a known category"
        if h.direction not in (pb.FORWARD, pb.BACKWARD):
            self.rejected += 1
            return None, f"{h.name}: direction {h.direction} is neither forward nor backward"
        try:
            job = decode_job(record, payload, self.limits)
        except WireError as exc:
            self.rejected += 1
            return None, f"{h.name}: malformed record: {exc}"
        except Exception as exc:  # noqa: BLE001 - a decoder bug must cost one record, never the stream or a restart
            self.rejected += 1
            log.error("%s (run %s rank %d seq %d): the decoder failed (%s: %s); the record is rejected", h.name,
                      log_text(h.run_id), h.rank, h.seq, type(exc).__name__, log_text(str(exc), 200))
            return None, f"{h.name}: the record cannot be decoded ({type(exc).__name__})"
        if not job.skip_reason:
            why = replayable(match.group(1), match.group(2), job.args, job.kwargs)
            if why is not None:
                self.rejected += 1
                return job, f"{h.name}: {why}"
        return job, ""

    def process(self, record: pb.Record, payload: bytes | bytearray | memoryview,
                reserved: int = 0) -> tuple[int, str]:
        """Validate a record replayed from the spool and hand its job (or SKIP row) to the workers.

        A spooled record that no longer validates is quarantined: a SKIP row, never fatal.
        """
        h = record.header
        match = valid_call_name(h.name)
        if match is not None and (not self.config.wants_rank(h.rank) or not self.config.wants(match.group(2))):
            self.filtered += 1
            self._reject_row(h, h.name, "", reserved=reserved, filtered=True)
            return ACCEPTED, ""
        job, reason = self.validate(record, payload)
        if reason:
            self._reject_row(h, h.name if match else f"invalid.record.{h.seq}", reason, job, reserved=reserved)
            return REJECTED, reason
        job.reserved = reserved
        self.dispatch(job)
        return ACCEPTED, ""

    def end_backed(self, end: pb.End) -> str:
        """'' when this end message may count (its run and rank sent records to this server); else why not.

        An end for a (run, rank) that never sent a record is acknowledged but not counted: it must not end a rank
        nor make `--exit-when-done` stop the server."""
        with self._lock:
            if self._seen.get((end.run_id, end.rank)):
                return ""
        return (f"no record of run '{log_text(end.run_id)}' rank {end.rank} reached this server; the end message is "
                "not counted")

    def _release(self, n: int) -> None:
        if self.budget is not None and n:
            self.budget.release(n)

    def _reject_row(self, h: pb.RecordHeader, name: str, reason: str, job: Job | None = None, reserved: int = 0,
                    filtered: bool = False) -> None:
        self._release(reserved)
        if filtered or not self.config.wants_rank(h.rank):
            # Nothing to report (spooled under an earlier config that wanted it): the spool entry is done.
            if self.spool is not None:
                self.spool.complete([(h.run_id, h.rank, h.seq)], [], {})
            return
        match = valid_call_name(name)
        category, api = (match.group(1), match.group(2)) if match else ("", "")
        job = job or Job(run_id=h.run_id if RUN_ID.match(h.run_id) else "invalid", rank=h.rank, step=h.step,
                         seq=h.seq, name=name, category=category, api=api, direction=h.direction or pb.FORWARD,
                         module=wire_text(h.module), source=wire_text(h.source))
        job.skip_reason = reason
        job.backward_expected = False
        job.reserved = 0
        self.dispatch(job)


def decode_job(record: pb.Record, payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Job:
    h = record.header
    match = valid_call_name(h.name)
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
    return job

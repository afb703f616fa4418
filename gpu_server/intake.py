"""Accepting records, whatever transport brought them (SPEC §4, §5.1).

`FrameAssembler` joins one stream's frames into (Record, payload), reserving the payload's bytes from the server's
memory budget first (`ByteBudget`). `Intake.submit` drops duplicates (same run, rank, seq), applies the rank and API
filters, writes the record to the durable spool (gpu_server/spool.py), validates the whole record (header, names,
tensor table, values) and hands a decoded `Job` to the workers; it returns a `Ticket` that holds the acknowledgement
once the record is durable. `Intake.accept` is the same, waiting for the ticket. Every outcome is an
acknowledgement status and, for bad records, a SKIP row.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from gpu_server.config import ServerConfig
from gpu_server.registry import replayable
from protos import online_check_pb2 as pb
from protos.codec import RecordDecoder, WireError
from protos.limits import DEFAULT_LIMITS, RUN_ID, Limits, valid_call_name

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


class ByteBudget:
    """Bytes of record payloads the server holds at once (assembling, spooling, queued for the workers).

    `acquire` waits until the bytes fit; one record larger than the whole budget is let through alone.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cv = threading.Condition()

    def acquire(self, n: int, cancelled: Callable[[], bool] = lambda: False) -> bool:
        with self._cv:
            while self.held and self.held + n > self.limit:
                if cancelled():
                    return False
                self._cv.wait(0.5)
            self.held += n
            self.peak = max(self.peak, self.held)
            return True

    def release(self, n: int) -> None:
        if n:
            with self._cv:
                self.held -= n
                self._cv.notify_all()


class FrameAssembler:
    """One stream's frames -> complete records. Frames of one record are contiguous and in offset order."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS, budget: ByteBudget | None = None,
                 cancelled: Callable[[], bool] = lambda: False):
        self.limits = limits
        self.budget = budget
        self.cancelled = cancelled
        self.record: pb.Record | None = None
        self.payload: list[bytes] | None = None   # the chunks of a multi-frame record
        self.filled = 0
        self.reserved = 0          # budget bytes held by the record being assembled (handed over when complete)

    def feed(self, frame: pb.Frame) -> tuple[pb.Record, bytes] | None:
        body = frame.WhichOneof("body")
        data = frame.data
        if body == "record":
            if self.record is not None:
                seq = self.record.header.seq
                self.reset()
                raise WireError(f"record {seq} was cut off by the next record after {self.filled} bytes")
            rec = frame.record
            if rec.payload_bytes > self.limits.max_record_bytes:
                raise WireError(f"record {rec.header.seq} announces {rec.payload_bytes} payload bytes, above the "
                                f"limit of {self.limits.max_record_bytes}")
            if self.budget is not None:
                if not self.budget.acquire(rec.payload_bytes, self.cancelled):
                    raise WireError(f"record {rec.header.seq}: the stream closed while waiting for server memory")
                self.reserved = rec.payload_bytes
            if len(data) == rec.payload_bytes:
                # The whole payload rode on this frame (records up to one chunk: the common case): use its bytes
                # as they are, without a second copy. Decoded tensors are read-only views; replay copies them.
                self.record, self.payload, self.filled = None, None, 0
                return rec, data
            # The chunks are kept as they arrive and joined once, at the end: a header alone, whatever it
            # announces, costs nothing, and each byte is copied once more only.
            self.record, self.filled, self.payload = rec, 0, []
            offset = 0
        elif body == "chunk":
            if self.record is None or frame.chunk.seq != self.record.header.seq:
                raise WireError(f"chunk of record {frame.chunk.seq} without its record header")
            offset = frame.chunk.offset
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
        self._seen: dict[tuple[str, int], set[int]] = {}
        self._lock = threading.Lock()
        self.received = 0
        self.duplicates = 0
        self.rejected = 0
        self.filtered = 0

    def mark_seen(self, run_id: str, rank: int, seq: int) -> bool:
        """True if new. The durable spool replays this on restart so duplicates are caught across restarts."""
        with self._lock:
            seen = self._seen.setdefault((run_id, rank), set())
            if seq in seen:
                return False
            seen.add(seq)
            return True

    def accept(self, record: pb.Record, payload: bytes | bytearray, reserved: int = 0) -> tuple[int, str]:
        """Take one complete record; returns its acknowledgement once the record is durable."""
        return self.submit(record, payload, reserved).wait()

    def submit(self, record: pb.Record, payload: bytes | bytearray, reserved: int = 0) -> Ticket:
        """Take one complete record; the returned ticket holds the acknowledgement once the record is durable.

        `reserved`: bytes of `self.budget` the payload holds (released here or once the workers checked it).
        """
        from gpu_server.spool import Ticket

        h = record.header
        self.received += 1
        if not RUN_ID.match(h.run_id):
            self.rejected += 1
            self._release(reserved)
            return Ticket(h.seq, REJECTED, f"record {h.seq}: run id {h.run_id[:80]!r} is not 1-64 letters, digits, "
                                           "'-' or '_'")
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
        ticket = self.spool.append(record, payload) if self.spool is not None else None
        status, reason = self.process(record, payload, reserved)
        if ticket is None:
            return Ticket(h.seq, status, reason)
        if status != ACCEPTED:  # its SKIP row is on the way; answer the rejection once the record is durable
            return Ticket(h.seq, status, reason, after=ticket)
        return ticket

    def process(self, record: pb.Record, payload: bytes | bytearray, reserved: int = 0, restore: bool = False
                ) -> tuple[int, str]:
        """Validate a record that is new (or replayed from the spool) and hand its job (or SKIP row) to the workers.

        `restore`: replayed from the spool after its detail rows were written; the workers rebuild its state only.
        """
        h = record.header
        match = valid_call_name(h.name)
        if match is None:
            self.rejected += 1
            reason = f"record {h.seq}: API name {h.name[:80]!r} is not Category.api.n with a known category"
            self._reject_row(h, f"invalid.record.{h.seq}", reason, reserved=reserved)
            return REJECTED, reason
        category, api = match.group(1), match.group(2)
        if not self.config.wants_rank(h.rank) or not self.config.wants(api):
            self.filtered += 1
            self._reject_row(h, h.name, "", reserved=reserved, filtered=True)
            return ACCEPTED, ""
        if h.direction not in (pb.FORWARD, pb.BACKWARD):
            self.rejected += 1
            reason = f"{h.name}: direction {h.direction} is neither forward nor backward"
            self._reject_row(h, h.name, reason, reserved=reserved)
            return REJECTED, reason
        try:
            job = decode_job(record, payload, self.limits)
        except WireError as exc:
            self.rejected += 1
            reason = f"{h.name}: malformed record: {exc}"
            self._reject_row(h, h.name, reason, reserved=reserved)
            return REJECTED, reason
        if not job.skip_reason:
            why = replayable(category, api, job.args, job.kwargs)
            if why is not None:
                self.rejected += 1
                self._reject_row(h, h.name, why, job, reserved=reserved)
                return REJECTED, f"{h.name}: {why}"
        job.reserved = reserved
        self._dispatch(job, restore)
        return ACCEPTED, ""

    def _dispatch(self, job: Job, restore: bool = False) -> None:
        if restore:
            self.dispatch(job, restore=True)
        else:
            self.dispatch(job)

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
                         seq=h.seq, name=name, category=category, api=api, direction=h.direction or pb.FORWARD)
        job.skip_reason = reason
        job.backward_expected = False
        job.reserved = 0
        self.dispatch(job)


def decode_job(record: pb.Record, payload: bytes | bytearray, limits: Limits = DEFAULT_LIMITS) -> Job:
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
        nbytes=len(payload),
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

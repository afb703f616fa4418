"""The one door from frames to records, whatever transport brought them (docs/design.md §6.2).

A transport (`RecordSource`: the gRPC service, gpu_server/intake/grpc_service.py; the shared-folder reader,
gpu_server/intake/folder.py)
reads bytes and hands each frame to its `RecordStream`, which owns the rest: header admission and the memory
reservation (`FrameAssembler`), joining chunks, splitting a Batch frame, the end message, and the answer to every
record (an Ack for one refused at once, else the intake's `Ticket`). Records refused at once are counted `rejected`
when their answer is given (`answer`), so a transport that answers a whole file at a time counts it once
(`refuse_file`).

The stream says what it needs done as steps: `Reserve` (budget bytes to wait for) and `Call` (work the gRPC event
loop runs on a thread). The transport performs them: `run` on a thread, `run_async` on an event loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Generator
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from google.protobuf.message import DecodeError

from gpu_server.intake.admission import Intake
from gpu_server.intake.assembler import FrameAssembler
from gpu_server.intake.budget import ByteBudget, ConnectionShare
from protos import online_check_pb2 as pb
from protos.codec import WireError
from protos.framing import parse_frame
from protos.limits import RUN_ID, Limits, log_text

if TYPE_CHECKING:
    from gpu_server.spool.store import Ticket

log = logging.getLogger("gpu_server")
# Validating a record costs what its header holds (values, the tensor table), not its tensor bytes (decoded tensors
# are views into the payload), except a strided tensor, which decoding copies. The records of one message are
# validated on the event loop when that is little work (a thread hand-off costs more than checking one large record:
# ~0.1-0.2 ms of CPU on a busy 2-core host), on a thread otherwise: more than INLINE_RECORDS records, more
# than INLINE_HEADER_BYTES of headers, or a strided tensor in a payload above INLINE_BYTES.
INLINE_RECORDS = 32
INLINE_HEADER_BYTES = 32 << 10
INLINE_BYTES = 256 << 10


class RecordSource(Protocol):
    """A transport bringing records to the intake, started and stopped by gpu_server/app.py."""

    def start(self) -> str:
        """Start reading; where it reads from, for the log."""

    def shutdown(self) -> None:
        """Stop reading: every record it acknowledged (or, for the folder, every file published) is handed on."""

    def counts(self) -> dict[str, int]:
        """Its own lines of the summary."""


class Reserve(NamedTuple):
    """Wait until `n` more bytes of the memory budget are granted to the stream (`order`: when its record started)."""
    n: int
    order: float | None


class Call(NamedTuple):
    """Run `fn(*args)`: on a thread when `heavy` and the transport is an event loop."""
    fn: Callable[..., Any]
    args: tuple
    heavy: bool


class Arrival(NamedTuple):
    """A complete record with the budget bytes it holds (its estimated peak), or why it is refused; `raw`: the
    record's bytes, where they were made already (a Batch frame's records)."""
    record: pb.Record
    payload: bytes | memoryview
    reserved: int
    why: str
    raw: bytes | None = None


Steps = Generator["Reserve | Call", Any, Any]


class Asked:
    """What `RecordStream.message` returns for an Ask frame: the agent wants the answers to everything it sent
    before it (docs/design.md §5, "Answers when asked")."""


ASKED = Asked()


class Stopped(Exception):
    """The stream was cancelled while it waited for the memory budget."""


def heavy(arrivals: list[Arrival]) -> bool:
    """Whether validating these records (completed by one message) is worth a thread (INLINE_RECORDS)."""
    if len(arrivals) > INLINE_RECORDS or sum(len(a.raw) if a.raw is not None else a.record.ByteSize()
                                             for a in arrivals) > INLINE_HEADER_BYTES:
        return True
    return (sum(len(a.payload) for a in arrivals) > INLINE_BYTES
            and any(meta.stride for a in arrivals for meta in a.record.tensors))


class RecordStream:
    """One stream's frames -> records handed to the intake, and the answers (Acks and Tickets) to send back."""

    def __init__(self, intake: Intake, limits: Limits, budget: ByteBudget | None, origin: str,
                 on_end: Callable[[pb.End], None], *, peer: str = "", where: str = "",
                 share: ConnectionShare | None = None, cancelled: Callable[[], bool] = lambda: False,
                 takes_asks: bool = False):
        self.intake, self.budget, self.origin, self.on_end = intake, budget, origin, on_end
        self.takes_asks = takes_asks   # the transport may hold answers until asked (the gRPC stream)
        self.peer, self.where = peer, where or f"stream from {peer}"   # who sends (gRPC), the log's prefix
        self.max_batch_records = limits.max_batch_records
        self.cancelled = cancelled
        self.asm = FrameAssembler(limits, budget, cancelled=cancelled, share=share)

    # -- frames ----------------------------------------------------------------------------------------------
    def message(self, raw: bytes) -> Steps:
        """The answers to one gRPC message (its bytes counted, `FrameAssembler.arrived`), in order; `ASKED` for an
        Ask frame. A Hello whose agent asks for its answers is answered ASKS_TAKEN where the transport takes asks."""
        try:
            frame, data = parse_frame(raw)   # data: a view into raw
        except DecodeError:
            self.asm.reset()
            return self.answers([pb.Ack(status=pb.Ack.REJECTED, reason=f"a {len(raw)}-byte message is not a valid "
                                        "Frame; this server speaks online_check.v1 protobuf only")])
        del raw
        body = frame.WhichOneof("body")
        if body == "hello":
            h = frame.hello
            log.info("agent connected from %s: run %s rank %d of %d (agent %s)", self.peer, log_text(h.run_id, 64),
                     h.rank, h.world_size, log_text(h.agent_version, 32))
            self.intake.adopt(h.run_id, h.rank, self.origin)
            return [pb.Ack(status=pb.Ack.ASKS_TAKEN)] if h.asks and self.takes_asks else []
        if body == "ask" and self.takes_asks:
            return ASKED
        if body == "end":
            return [(yield from self.end(frame.end))]
        items = yield from self.records(frame, data)
        del frame, data
        arrivals = [item for item in items if isinstance(item, Arrival)]
        if arrivals:
            return (yield Call(self.answers, (items,), heavy(arrivals)))
        return self.answers(items)

    def records(self, frame: pb.Frame, data: bytes | memoryview,
                check: Callable[[list[pb.Record]], None] = lambda records: None) -> Steps:
        """What a record, chunk or Batch frame brings: Acks for what is refused at once (not counted yet: `answers`)
        and an `Arrival` for each record it completes. `check(records)`: the transport's own refusal of a record
        header or a batch's records (raises), before anything is reserved for them."""
        asm = self.asm
        body = frame.WhichOneof("body")
        out: list = []
        cut = asm.cut_off() if body in ("record", "batch") else None
        if cut is not None:   # the record before was cut off: refuse it
            out.append(pb.Ack(seq=cut[0], status=pb.Ack.REJECTED, reason=cut[1]))
        if body == "batch":
            return out + (yield from self._batch(frame, data, check))
        seq = frame.record.header.seq if body == "record" else frame.chunk.seq if body == "chunk" else 0
        try:
            if body == "record":
                check([frame.record])
            extra = asm.before(frame, data)
            if extra and self.budget is not None:
                # the rest of the record's peak: a stream waiting here reads nothing (back-pressure)
                yield Reserve(extra, asm.started or None)
                asm.granted(extra)
            if asm.completes(frame, data):
                done = yield Call(asm.feed, (frame, data), True)   # the join copies
            else:
                done = asm.feed(frame, data)
        except WireError as exc:
            return out + [pb.Ack(seq=seq, status=pb.Ack.REJECTED, reason=str(exc))]
        if done is None:
            return out
        return out + [Arrival(done[0], done[1], asm.take_reserved(), "")]

    def _batch(self, frame: pb.Frame, data: bytes | memoryview, check: Callable[[list[pb.Record]], None]) -> Steps:
        """Several complete records in one frame: their peaks reserved together, then each with its own copy of its
        payload, answered as if it had come alone."""
        asm = self.asm
        try:
            parts = asm.batch(frame, data)
        except WireError as exc:
            seqs = [r.header.seq for r in frame.batch.records[:self.max_batch_records]] or [0]
            return [pb.Ack(seq=seq, status=pb.Ack.REJECTED, reason=str(exc)) for seq in seqs]
        check([part[0] for part in parts])
        del frame, data
        total = sum(part[2] for part in parts)
        if self.budget is not None and total:
            yield Reserve(total, None)   # a stream waiting here reads nothing
            asm.granted(total)
        return [Arrival(rec, payload, need if self.budget is not None else 0, why, raw)
                for rec, payload, need, why, raw in asm.unbatch(parts)]

    def end(self, end: pb.End) -> Steps:
        """The answer to an end message; it counts (`on_end`, durable before END_ACCEPTED) only when
        `Intake.end_backed` says so."""
        if not RUN_ID.match(end.run_id):
            return pb.Ack(status=pb.Ack.REJECTED, reason="end message with an invalid run id")
        why = self.intake.end_backed(end, self.origin)
        if why:
            log.warning("%s: end message of run %s rank %d not counted: %s", self.where, log_text(end.run_id, 64),
                        end.rank, why)
        else:
            yield Call(self.on_end, (end,), True)
        return pb.Ack(seq=end.last_seq, status=pb.Ack.END_ACCEPTED, reason=why)

    # -- answers ---------------------------------------------------------------------------------------------
    def answer(self, item: pb.Ack | Arrival) -> pb.Ack | Ticket:
        """The answer to one item of `records`: a refused record counted `rejected`, a complete one handed to the
        intake (its ticket)."""
        if isinstance(item, Arrival) and not item.why:
            return self.intake.submit(item.record, item.payload, item.reserved, self.origin, item.raw)
        self.intake.rejected += 1
        if isinstance(item, Arrival):
            return pb.Ack(seq=item.record.header.seq, status=pb.Ack.REJECTED, reason=item.why)
        return item

    def answers(self, items: list) -> list:
        return [self.answer(item) for item in items]

    def accept(self, item: Arrival) -> tuple[int, str]:
        """`answer`, waiting (a thread) until the record is durable: (status, reason)."""
        out = self.answer(item)
        return (out.status, out.reason) if isinstance(out, pb.Ack) else out.wait()

    def refuse_file(self) -> None:
        """A transport refused a whole file of records at once: one answer, counted `rejected`."""
        self.intake.rejected += 1

    def release(self, items: list) -> None:
        """Give back the budget bytes of records never handed to the intake."""
        if self.budget is not None:
            self.budget.release(sum(item.reserved for item in items if isinstance(item, Arrival)))

    # -- performing the steps --------------------------------------------------------------------------------
    def run(self, steps: Steps) -> Any:
        """Perform `steps` on this thread; raises Stopped when cancelled while waiting for the budget."""
        reply: Any = None
        error: Exception | None = None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value
            reply, error = None, None
            try:
                if isinstance(step, Call):
                    reply = step.fn(*step.args)
                elif not self.budget.acquire(step.n, self.cancelled, own=self.asm.holding, order=step.order):
                    raise Stopped()
            except Exception as exc:  # noqa: BLE001 - the steps decide what they refuse
                error = exc

    async def run_async(self, steps: Steps, executor: Executor) -> Any:
        """Perform `steps` on the event loop, heavy calls on `executor`; waiting for the budget reads nothing."""
        loop = asyncio.get_running_loop()
        reply: Any = None
        error: Exception | None = None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value
            reply, error = None, None
            try:
                if isinstance(step, Call):
                    reply = (await loop.run_in_executor(executor, step.fn, *step.args) if step.heavy
                             else step.fn(*step.args))
                else:
                    await self.budget.acquire_async(step.n, own=self.asm.holding, order=step.order)
            except Exception as exc:  # noqa: BLE001 - the steps decide what they refuse
                error = exc

"""Accepting records, whatever transport brought them (docs/security.md, "Who can reach the port or the folder").

A record assembled by gpu_server/intake/admission/assembler.py comes here once, through the transport's RecordStream
(gpu_server/intake/admission/stream.py). `Intake.submit`
drops duplicates (same run, rank, seq), applies the rank and API filters, validates the whole record (header, strict
names, tensor table, every value decoded, the replay registry) and only then writes it to the durable spool
(gpu_server/spool/store.py) and hands the decoded `Job` to the workers; it returns a `Ticket` that holds the
acknowledgement once the record is durable. A record that fails validation is answered REJECTED at once with the
reason and a SKIP row, and is never spooled; it is counted `rejected` when it breaks the wire contract (malformed,
hostile, refused sizes or names) and `not_replayable` when it is valid but cannot be replayed here (its arguments, an
API this host lacks). `Intake.accept` is the same, waiting for the ticket. `Intake.end_backed`
says whether an end message may count (its run and rank sent records).
"""
from __future__ import annotations

import logging
import queue
import re
import threading
from typing import TYPE_CHECKING, Callable

from gpu_server.collective_info import CollectiveError
from gpu_server.config import ServerConfig
from gpu_server.decode import decode_job, wire_text
from gpu_server.intake.budget import ByteBudget
from gpu_server.job import Job
from gpu_server.replay.registry import name_refused, replayable
from gpu_server.seqset import SeqSet
from gpu_server.spool.acks import Ticket
from protos import online_check_pb2 as pb
from protos.codec import WireError
from protos.limits import DEFAULT_LIMITS, RUN_ID, Limits, log_text, valid_call_name

log = logging.getLogger("gpu_server")

if TYPE_CHECKING:
    from gpu_server.spool.store import Spool

ACCEPTED, DUPLICATE, REJECTED = pb.Ack.ACCEPTED, pb.Ack.DUPLICATE, pb.Ack.REJECTED


MAX_ORIGINS = 16   # connections (or certificates) remembered per run and rank as having sent its records


class Intake:
    def __init__(self, config: ServerConfig, dispatch: Callable[..., None], limits: Limits = DEFAULT_LIMITS,
                 on_end: Callable[[pb.End], None] | None = None, *, spool: Spool | None = None,
                 budget: ByteBudget | None = None, world_size: int | None = None,
                 not_reported: Callable[[str, int, int], None] = lambda run_id, rank, seq: None):
        self.config = config
        self.dispatch = dispatch
        # a spooled record this server reports nothing for: PendingCalls decides its journal line
        # (gpu_server/checking/pending.py, through WorkerPool.not_reported)
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
            return seen.add(seq)   # (False: seen before)

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
               origin: str = "", raw: bytes | None = None) -> Ticket:
        """Take one complete record; the returned ticket holds the acknowledgement once the record is durable.

        The record is validated completely (header, name, tensor table, every value decoded) before it is spooled:
        a record that would fail to decode is answered REJECTED at once with the reason, gets its SKIP row, and is
        never spooled (so a restart never meets it). `reserved`: bytes of `self.budget` the record holds (its
        estimated peak, `check_peak`: released here, or by the workers once they checked it). `origin`: the
        connection or certificate it came over (`end_backed`). `raw`: the record's bytes, where the transport made
        them already (the decoder and the spool take them). A rank at or above --world-size, or a (run, rank)
        beyond --max-run-ranks, is answered REJECTED and never reported (no report files for it).
        """
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
        status, reason, job = self._classify(record, payload, reserved, raw)
        if job is None:
            return Ticket(h.seq, status, reason)
        ticket = None
        if self.spool is not None:   # (the Record's bytes, where the decoder read them)
            ticket = self.spool.append(record, payload, job.wire[2] if job.wire else None)
        if ticket is not None and self.budget is not None and reserved:
            self._spool_hold(ticket, len(payload))
        self.dispatch(job)
        return ticket if ticket is not None else Ticket(h.seq, ACCEPTED)

    def _classify(self, record: pb.Record, payload: bytes | bytearray | memoryview,
                  reserved: int, raw: bytes | None = None) -> tuple[int, str, Job | None]:
        """The rank and API filters, then `validate`, once per record (its call name checked once): (ACCEPTED, '',
        job) for a record to check (holding `reserved`); (ACCEPTED, '', None) for one the filters leave out (counted
        `filtered`), (REJECTED, why, None) once its SKIP row is dispatched: `reserved` released."""
        h = record.header
        match = valid_call_name(h.name)
        if match is not None and (not self.config.wants_rank(h.rank) or not self.config.wants(match.group(2))):
            self.filtered += 1
            self._release(reserved)
            return ACCEPTED, "", None
        job, reason = self.validate(record, payload, match, raw)
        if reason:
            self._reject_row(h, h.name if match else f"invalid.record.{h.seq}", match, reason, job, reserved)
            return REJECTED, reason, None
        assert job is not None
        job.reserved = reserved
        return ACCEPTED, "", job

    def validate(self, record: pb.Record, payload: bytes | bytearray | memoryview,
                 match: re.Match[str] | None, raw: bytes | None = None) -> tuple[Job | None, str]:
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
            job = decode_job(record, payload, self.limits, self._max_ranks(), match, raw)
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
            # checked across ranks, never replayed (gpu_server/checking/collectives.py): every member must be a rank
            # this
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

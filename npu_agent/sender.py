"""The background sender: a bounded queue between the training thread and the transport.

The training thread only calls `submit()`. Everything else (host copies, encoding, sending, acknowledgements,
re-sending after a reconnect) happens on the sender's own thread and the transport's threads. Small records that
queued up while the transport was busy go to it together, as one batch. The Sender talks to
its transport only through `npu_agent.transport.Transport`, and receives its events as `TransportEvents`.

Lingering: a small record that finds the sender idle waits up to `LINGER_S` for others to join it in one message,
unless a full batch or a large record is queued meanwhile, the training waits for room, or `close` waits. A captured
step's calls then go out in a few messages instead of one each: every message costs the agent's threads a few
hundred microseconds of CPU beyond its bytes (gRPC's threads, the acknowledgement), and each wake-up of the sender
takes the interpreter lock from the training. Records that queued while the transport was busy go at once.

Memory: a record counts against the budget from `submit()` until the server acknowledges it (it is kept for
re-sending until then). The frames of acknowledged records (a large record's own, a Batch of small ones) are kept
for reuse by the next frames of their size class, up to a quarter of the budget more, until `close`
(npu_agent/payload.py, `FRAMES`). At the budget, the policy applies: `block` waits (nothing is lost), `drop` drops
the newest record and counts it. One record larger than the whole budget is sent alone (blocking) rather than never.

CPU: the sender's thread adds up the CPU it spends (`time.thread_time()` around its work), and the CPU of the
transport threads that deliver acknowledgements is read from their thread clocks: `cpu_seconds()` is the running
total the overhead budget charges (npu_agent/sampling.py), `records_done` the records it covers.

Answers when asked: a transport whose server holds its answers until asked (`ask`; the gRPC stream, docs/design.md
§5) is asked for them after a quarter of the budget or ASK_RECORDS records sent, at once when the training or `close`
waits for room, and when the sender has been idle for ASK_AFTER_S with records sent and not asked for. One answer
then covers many records: the server writes, and the agent's threads read, far fewer messages.

Refusal: when the transport reports that it can never deliver (`on_refused`), everything held is dropped and
counted, `submit` returns at once from then on, and `close` does not wait.
While the training waits for the budget, or `close` waits for acknowledgements, a line is logged every 30 s.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

from npu_agent.payload import FRAMES
from npu_agent.records import PendingRecord, encode_record, encode_together
from npu_agent.transport import Counts, Refusal, Transport, end_frame

log = logging.getLogger("npu_agent")

WAIT_LOG_S = 30.0   # the period of the "still waiting" lines
# Small records waiting together go out as one message (protos/framing.py, "Batch"): records up to
# BATCH_RECORD_BYTES each, at most BATCH_RECORDS and BATCH_BYTES of tensors a message. A record up to 256 KiB is
# encoded into one buffer, or straight into its batch's frame (npu_agent.records: larger ones into their own frames).
BATCH_RECORD_BYTES = 256 << 10
BATCH_BYTES = 2 << 20
BATCH_RECORDS = 512
LINGER_S = 0.003   # how long a small record that found the sender idle waits for others (see above)
# Answers when asked (module docstring): the sender asks once it has sent a quarter of its budget or ASK_RECORDS
# records since it last asked, at once when the training or `close` waits for room, and after ASK_AFTER_S idle.
ASK_RECORDS = 2048
ASK_AFTER_S = 0.005
_THREAD_CLOCKS = hasattr(time, "pthread_getcpuclockid")   # Unix: another thread's CPU clock


class Sender:
    """Implements `npu_agent.transport.TransportEvents` for its transport."""

    def __init__(self, transport: Transport, budget_bytes: int, policy: str = "block"):
        self.transport = transport
        self.budget = budget_bytes
        self.policy = policy
        self.counts = Counts()
        self.job = ""                      # the training's id on the End message (npu_agent.collectives.job_id)
        # One lock, two conditions: the sender thread waits for `_work` (records, a re-send, the end), the training
        # (budget) and `close` (acknowledgements) wait for `_room`. Each side is woken only for what it waits for.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        self._sender_idle = False          # the sender thread waits for `_work`
        self._lingering = False            # ... for more small records to join the first (`_linger`)
        self._room_wanted: list[int] = []  # bytes each waiter on `_room` needs (close: more than the budget)
        self._queue: collections.deque[PendingRecord] = collections.deque()
        self._queued_bytes = 0             # of the records in `_queue`
        self._queued_large = 0             # records in `_queue` above BATCH_RECORD_BYTES (each goes alone)
        self._unacked: dict[int, PendingRecord] = {}
        self._held = 0                     # bytes of records submitted and not yet acknowledged
        self._next_seq = 0
        self._resend = False
        self._resend_gen = 0
        self._gen = 0                      # the transport stream the queue's order is valid for
        self._closing = False
        self._refusal: Refusal | None = None
        self._ask = getattr(transport, "ask", None)   # the transport's `ask`, where its server may wait to be asked
        self._unasked = 0                  # bytes sent on stream `_gen` since the sender last asked for answers
        self._unasked_records = 0          # ... and records
        self._warned_block = -WAIT_LOG_S
        # the agent's CPU outside the training thread (the overhead budget charges it): the sender thread's own,
        # added up by that thread, and that of the transport threads that deliver acknowledgements
        self.sender_cpu = 0.0
        self.records_done = 0              # records the sender thread has encoded and handed to the transport
        self._ack_clocks: dict[int, int] = {}   # thread ident -> its CPU clock id
        self._ack_cpu: dict[int, float] = {}    # thread ident -> its CPU at the last reading
        self._ended_cpu = 0.0                   # the CPU of such threads that ended
        # a transport that writes files copies large records' tensors straight into them (no frames in memory)
        self._defer = bool(getattr(transport, "copies_into_files", False))
        if not self._defer:   # acknowledged large frames kept for reuse: at most a quarter of the budget more
            FRAMES.limit = max(FRAMES.limit, budget_bytes // 4)   # (npu_agent/payload.py)
        self._thread = threading.Thread(target=self._run, name="online-check-sender", daemon=True)
        self._thread.start()
        transport.start(self)   # the transport connects only now: no stream notification can be missed

    @property
    def refusal(self) -> Refusal | None:
        """Why the transport can never deliver (then nothing is captured any more), or None."""
        return self._refusal

    # -- training thread -----------------------------------------------------------------------------------
    def submit(self, rec: PendingRecord) -> bool:
        size = rec.held_bytes = rec.nbytes
        with self._lock:
            self.counts.captured += 1
            while self._held + size > self.budget and self._held > 0 and self._refusal is None:
                if self.policy == "drop" or self._closing:
                    self.counts.dropped += 1
                    return False
                now = time.monotonic()
                if now - self._warned_block >= WAIT_LOG_S:
                    self._warned_block = now
                    log.warning("online check: %d MiB of records are waiting for the server (budget %d MiB); the "
                                "training waits (policy 'block'). %s", self._held >> 20, self.budget >> 20,
                                self.transport.describe_state())
                self._room_wanted.append(size)
                self._wants_room()
                self._room.wait(1.0)
                self._room_wanted.remove(size)
            if self._refusal is not None:
                self.counts.dropped += 1
                return False
            rec.seq = self._next_seq
            self._next_seq += 1
            self._held += size
            self._unacked[rec.seq] = rec
            self._queue.append(rec)
            self._queued_bytes += size
            if size > BATCH_RECORD_BYTES:
                self._queued_large += 1
            if self._sender_idle:
                self._work.notify()
            elif self._lingering and not self._batch_open():
                self._end_linger()
        return True

    def cpu_seconds(self) -> float:
        """CPU spent so far by the sender thread and the transport threads that delivered acknowledgements."""
        total = self.sender_cpu + self._ended_cpu
        for ident, clock in list(self._ack_clocks.items()):
            try:
                seconds = self._ack_cpu[ident] = time.clock_gettime(clock)
            except OSError:   # that thread ended (a reconnect): its last reading stays counted
                self._ack_clocks.pop(ident, None)
                seconds = self._ack_cpu.pop(ident, 0.0)
                self._ended_cpu += seconds
            total += seconds
        return total

    # -- sender thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        cpu = time.thread_time()
        while True:
            with self._lock:
                woken = idle_long = ask = False
                while not self._queue and not self._resend and not self._closing and self._refusal is None:
                    if self._unasked_records and (idle_long or self._room_wanted):
                        ask = True   # records sent and not asked for, and the sender idle a while or room wanted
                        break
                    self._sender_idle = woken = True
                    idle_long = not self._work.wait(ASK_AFTER_S if self._unasked_records else None)
                    self._sender_idle = False
                if not ask and woken:
                    self._linger()
                gen = self._gen
            if ask:
                self._ask_for_answers(gen)
                continue
            with self._lock:
                if self._refusal is not None:
                    return
                if self._resend:
                    # A new stream: everything not acknowledged goes again, in sequence order, before anything new
                    # (the server checks a rank's records in arrival order: a backward must follow its forward).
                    self._resend = False
                    self._gen = self._resend_gen
                    self._queue = collections.deque(sorted(self._unacked.values(), key=lambda r: r.seq))
                    self._queued_bytes = sum(r.held_bytes for r in self._queue)
                    self._queued_large = sum(r.held_bytes > BATCH_RECORD_BYTES for r in self._queue)
                    self._unasked = self._unasked_records = 0   # a new stream: nothing sent on it yet
                if not self._queue:
                    if self._closing:
                        return
                    continue
                batch = self._take_batch()
                gen = self._gen
            ready = batch if self._encode_together(batch) else [rec for rec in batch if self._encode(rec)]
            if not ready:
                continue
            sent = self.transport.send_records(ready, gen)
            with self._lock:
                if not sent:
                    # The stream changed under us: wait for the re-send that the new stream triggers (the records
                    # stay in _unacked and go out again in order).
                    while not self._resend and not self._closing and self._refusal is None:
                        self._work.wait(1.0)
                    continue
                self.counts.sent += len(ready)
                ask = False
                if self._ask is not None and gen == self._gen:
                    self._unasked += sum(rec.held_bytes for rec in ready)
                    self._unasked_records += len(ready)
                    ask = self._unasked >= self.budget // 4 or self._unasked_records >= ASK_RECORDS
            if ask:
                self._ask_for_answers(gen)
            now = time.thread_time()   # this thread's CPU, added up per batch (read by the budget meanwhile)
            self.sender_cpu += now - cpu
            self.records_done += len(batch)
            cpu = now

    def _batch_open(self) -> bool:
        """(Under the lock.) Whether more small records could still join the queued ones in one message."""
        return not self._queued_large and len(self._queue) < BATCH_RECORDS and self._queued_bytes < BATCH_BYTES

    def _linger(self) -> None:
        """(Under the lock.) Wait up to LINGER_S for more small records to join the queued ones, while nothing
        else needs the sender: a re-send, the end, the training or `close` waiting for room (module docstring)."""
        if not self._batch_open():
            return
        deadline = time.monotonic() + LINGER_S
        self._lingering = True
        while (self._lingering and not self._resend and not self._closing and self._refusal is None
               and not self._room_wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._work.wait(left)
        self._lingering = False

    def _ask_for_answers(self, gen: int) -> None:
        """Ask stream `gen`'s server for the answers to what was sent on it (`Transport.ask`; a server that answers
        unasked needs nothing, and a stream gone re-sends what it did not answer)."""
        assert self._ask is not None
        self._ask(gen)
        with self._lock:
            if gen == self._gen:
                self._unasked = self._unasked_records = 0

    def _wants_room(self) -> None:
        """(Under the lock.) The training or `close` waits for room: the sender stops lingering, and an idle sender
        asks at once for the answers to what it sent."""
        self._end_linger()
        if self._sender_idle and self._unasked_records:
            self._work.notify()

    def _end_linger(self) -> None:
        """(Under the lock.) The sender stops lingering now."""
        if self._lingering:
            self._lingering = False
            self._work.notify()

    def _take_batch(self) -> list[PendingRecord]:
        """The next record, with the small ones queued right behind it (under the lock): those that piled up while
        the transport was busy, or joined it while the sender lingered."""
        first = self._queue.popleft()
        batch = [first]
        total = first.held_bytes
        if total > BATCH_RECORD_BYTES:
            self._queued_large -= 1
        else:
            while self._queue and len(batch) < BATCH_RECORDS:
                size = self._queue[0].held_bytes
                if size > BATCH_RECORD_BYTES or total + size > BATCH_BYTES:
                    break
                batch.append(self._queue.popleft())
                total += size
        self._queued_bytes -= total
        return batch

    def _encode_together(self, batch: list[PendingRecord]) -> bool:
        """Small records that go out in one Batch frame are encoded straight into it (npu_agent.records.
        encode_together). False when that does not apply, or failed: each is then encoded alone."""
        if len(batch) < 2:
            return False
        who = self.transport.identity
        try:
            return encode_together(batch, who.run_id, who.rank)
        except Exception as exc:  # noqa: BLE001 - each record is then encoded alone, and counted lost if that fails
            log.debug("online check: records %d.. could not be encoded together (%s: %s)", batch[0].seq,
                      type(exc).__name__, exc)
            return False

    def _encode(self, rec: PendingRecord) -> bool:
        """Encode `rec` once (its copy of the tensors). False when that failed: the record is counted as lost."""
        who = self.transport.identity
        try:
            encode_record(rec, who.run_id, who.rank, self.transport.chunk_bytes, defer=self._defer)
            return True
        except Exception as exc:  # noqa: BLE001 - an encoding bug must not stop the sender
            log.warning("online check: could not encode %s (%s: %s); it is reported as lost", rec.name,
                        type(exc).__name__, exc)
            self._release(range(rec.seq, rec.seq + 1), rejected=True)
            return False

    # -- transport events ----------------------------------------------------------------------------------
    def on_ack(self, seq: int, status: str, reason: str, count: int = 1) -> None:
        ident = threading.get_ident()
        # a transport thread's CPU counts from now on (not the sender thread's own: the folder acknowledges there)
        if ident not in self._ack_clocks and ident != self._thread.ident and _THREAD_CLOCKS:
            try:
                self._ack_clocks[ident] = time.pthread_getcpuclockid(ident)
            except OSError:
                pass
        if status == "REJECTED":
            log.warning("online check: the server rejected record%s %s: %s", "s" if count > 1 else "",
                        seq if count == 1 else f"{seq}..{seq + count - 1}", reason)
        self._release(range(seq, seq + count), rejected=(status == "REJECTED"), duplicate=(status == "DUPLICATE"))

    def _release(self, seqs: range, rejected: bool = False, duplicate: bool = False) -> None:
        """Let records `seqs` go (acknowledged, or lost): under one lock, one wake-up for all of them."""
        with self._lock:
            released = 0
            for seq in seqs:
                rec = self._unacked.pop(seq, None)
                if rec is None:
                    continue
                released += 1
                self._held -= rec.held_bytes
                enc = rec.encoded
                if enc is not None:
                    # its frames, for the next frames of their size class (npu_agent/payload.py): given before anyone
                    # waiting for room is woken, who may take one; a Batch frame by the first of its records
                    if enc.frames:
                        FRAMES.give(enc.frames)
                    elif enc.batch is not None and not enc.batch.given:
                        enc.batch.given = True
                        FRAMES.give([enc.batch.frame])
                    rec.encoded = None
            if not released:
                return
            if rejected:
                self.counts.rejected += released
            else:
                self.counts.acknowledged += released
                if duplicate:
                    self.counts.duplicates += released
            if self._room_wanted and (not self._unacked or self._held + min(self._room_wanted) <= self.budget):
                self._room.notify_all()

    def on_reconnect(self, generation: int) -> None:
        with self._lock:
            self._resend = True
            self._resend_gen = generation
            self._work.notify_all()

    def on_refused(self, refusal: Refusal) -> None:
        with self._lock:
            if self._refusal is not None:
                return
            self._refusal = refusal
            self.counts.dropped += len(self._unacked)
            self._unacked.clear()
            self._queue.clear()
            self._queued_bytes = self._queued_large = 0
            self._held = 0
            self._work.notify_all()
            self._room.notify_all()

    # -- end of stream -------------------------------------------------------------------------------------
    def close(self, timeout: float) -> dict[str, Any]:
        """Wait until every record is acknowledged (at most `timeout`, and at most the transport's connect timeout
        when no server was ever reached), send the end message, return the counts."""
        start = time.monotonic()
        deadline = start + timeout
        never_reached = start + self.transport.connect_timeout_s
        logged = start
        with self._lock:
            while (self._unacked or self._queue) and self._refusal is None:
                now = time.monotonic()
                if now >= deadline or (now >= never_reached and not self.transport.reached):
                    break
                if now - logged >= WAIT_LOG_S:
                    logged = now
                    log.warning("online check: close() is waiting for the server to acknowledge %d records (%d MiB), "
                                "up to %.0f s more. %s", len(self._unacked), self._held >> 20, deadline - now,
                                self.transport.describe_state())
                self._room_wanted.append(self.budget + 1)   # woken when nothing is left unacknowledged
                self._wants_room()
                self._room.wait(min(1.0, max(0.01, deadline - now)))
                self._room_wanted.remove(self.budget + 1)
            self._closing = True
            self._work.notify_all()
            self._room.notify_all()
            lost = len(self._unacked)
            refused = self._refusal is not None
        # With records still unacknowledged the sender thread may be waiting on a server that is gone: do not wait
        # long for it (it is a daemon thread; the transport's close ends its wait).
        self._thread.join(timeout=0.5 if lost or refused else 5)
        counts: dict[str, Any] = dataclasses.asdict(self.counts)
        counts["unacknowledged"] = lost
        counts["last_seq"] = self._next_seq
        counts["server_reached"] = self.transport.reached
        if refused:
            self.transport.close()
        else:
            wait = max(1.0, deadline - time.monotonic()) if self.transport.reached else 1.0
            self.transport.send_end(end_frame(self.transport.identity, self.counts, self._next_seq, self.job),
                                     wait)
        FRAMES.clear()   # the frames kept for reuse are not kept past the checker's end
        return counts

"""The one owner of a call's lifecycle on the server: from its first record to its result row, and what the
spool's journal says about each record (gpu_server/spool_journal.py).

A record is identified by a `RecordKey` (run, rank, seq), a call by a `CallKey` (run, rank, step, name), both
defined in gpu_server/job.py. Every decision about what is reported and journaled is made here, whatever ends the
wait:

| event                              | rows written                        | journal                               |
|------------------------------------|-------------------------------------|---------------------------------------|
| forward checked, no backward comes | details + result                    | record `d` (done)                     |
| forward checked, backward expected | details; the call waits here        | record `h` (half: stays in the spool) |
| forward SKIP, backward expected    | SKIP details; the call waits here   | record `h` (its backward: SKIP too)   |
| its backward checked               | backward details + result           | both records `d`                      |
| the rank ended (End message)       | result, backward SKIP "never came"  | the forward `d`                       |
| forward inputs evicted (memory)    | later: backward SKIP naming the cap | unchanged until the backward comes    |
| the server stops (SIGTERM, Ctrl-C) | none                                | unchanged: `h` stays, the spool keeps |
|                                    |                                     | the record for the restart            |
| restart: an `h` record comes back  | none (its details exist)            | unchanged; it waits here again        |
| a record cannot be read or decoded | a SKIP row (quarantine)             | `d`                                   |

Forward jobs kept for their backward replay are bounded by `--backward-memory-mb`; the oldest are evicted first
(the call still waits: its backward gets a SKIP row that names the option).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import Any

from gpu_server.job import CallKey, RecordKey, call_key, record_key

log = logging.getLogger("gpu_server")


@dataclasses.dataclass
class Completion:
    """What one step of the lifecycle lets the journal say: `done` records are completely reported, `half`
    records have their forward detail rows written while the call waits for its backward record."""

    done: list[RecordKey] = dataclasses.field(default_factory=list)
    half: list[RecordKey] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: Completion) -> Completion:
        self.done += other.done
        self.half += other.half
        return self


@dataclasses.dataclass
class Waiting:
    """A forward call waiting for its backward record."""

    record: RecordKey
    outcome: Any                  # the forward's checker.Outcome
    job: Any | None               # the forward job, kept for the backward replay; None once evicted
    nbytes: int = 0

    @property
    def evicted(self) -> bool:
        return self.job is None


class PendingCalls:
    """Calls waiting for their backward record, and the records restored from the spool after a restart.
    Thread-safe: every worker shares one."""

    def __init__(self, backward_budget: int, restored: set | frozenset = frozenset()):
        self.budget = backward_budget
        self.held = 0
        self._lock = threading.Lock()
        self._waiting: dict[CallKey, Waiting] = {}
        self._kept: OrderedDict[CallKey, None] = OrderedDict()   # waiting calls whose forward job is kept, oldest first
        self._restored: set[RecordKey] = {RecordKey(*k) for k in restored}
        self.evictions = 0

    # -- restart -----------------------------------------------------------------------------------------------
    def is_restored(self, job) -> bool:
        """A forward record journaled `h` before a restart: its detail rows exist, only its wait is rebuilt."""
        with self._lock:
            return record_key(job) in self._restored

    # -- forward -----------------------------------------------------------------------------------------------
    def forward_done(self, job) -> Completion:
        """A forward call whose rows (result row included) are written."""
        with self._lock:
            self._restored.discard(record_key(job))
        return Completion(done=[record_key(job)])

    def hold(self, job, outcome) -> tuple[Completion, Waiting | None]:
        """The forward call's detail rows are written; it waits for its backward record. Returns what to journal
        and a call displaced by a second forward record of the same call (its result row is still to write)."""
        key, rec = call_key(job), record_key(job)
        with self._lock:
            restored = rec in self._restored
            self._restored.discard(rec)
            displaced = self._pop(key)
            self._waiting[key] = Waiting(rec, outcome, job, job.nbytes)
            self._kept[key] = None
            self.held += job.nbytes
            while self.held > self.budget and len(self._kept) > 1:
                victim = self._waiting[next(iter(self._kept))]
                self._kept.popitem(last=False)
                self.held -= victim.nbytes
                victim.job = None
                self.evictions += 1
        return Completion(half=[] if restored else [rec]), displaced

    # -- backward ----------------------------------------------------------------------------------------------
    def take(self, job) -> Waiting | None:
        """The backward record of a call arrived: the waiting forward (None if none waits)."""
        with self._lock:
            return self._pop(call_key(job))

    def _pop(self, key: CallKey) -> Waiting | None:
        w = self._waiting.pop(key, None)
        if w is not None and key in self._kept:
            del self._kept[key]
            self.held -= w.nbytes
        return w

    @staticmethod
    def backward_done(job, forward: Waiting | None) -> Completion:
        done = [record_key(job)]
        if forward is not None:
            done.append(forward.record)
        return Completion(done=done)

    # -- end of a rank, stop -----------------------------------------------------------------------------------
    def rank_ended(self, run_id: str, rank: int) -> list[tuple[CallKey, Waiting]]:
        """The rank sent its End: every call still waiting gets its result row now (the caller journals them)."""
        with self._lock:
            keys = [k for k in self._waiting if k.run_id == run_id and k.rank == rank]
            return [(k, self._pop(k)) for k in keys]

    def waiting_count(self) -> int:
        with self._lock:
            return len(self._waiting)

    def stop(self) -> int:
        """The server stops: nothing is reported or journaled for the waiting calls; their forward records stay in
        the spool (journaled `h`) and a restart with the same --out waits for their backward records again."""
        n = self.waiting_count()
        if n:
            log.warning("%d calls of ranks that have not ended wait for their backward records; they stay in the "
                        "spool and are finished after a restart with the same --out", n)
        return n

"""The one owner of a call's lifecycle on the server: from its first record to its result row, and what the
spool's journal says about each record (gpu_server/spool/journal.py). `PendingCalls` decides, the checker computes:
for each job a worker hands it, `PendingCalls.check` asks gpu_server/checking/checker.py for the rows (values), has the
worker
write them (`write`, before the next decision) and returns what the journal may say (`Completion`).

A record is identified by a `RecordKey` (run, rank, seq), a call by a `CallKey` (run, rank, step, name), both
defined in gpu_server/job.py. Every decision about what is reported and journaled is made here, whatever ends the
wait:

| event                              | rows written                        | journal                               |
|------------------------------------|-------------------------------------|---------------------------------------|
| forward checked, no backward comes | details + result                    | record `d` (done)                     |
| forward checked, backward expected | details; the call waits here        | record `h` (half: stays in the spool) |
| forward SKIP, backward expected    | SKIP details; the call waits here   | record `h` (its backward: SKIP too)   |
| its backward checked               | backward details + result           | both records `d`                      |
| a second forward of a waiting call | the first one's result (backward    | the first `d`, the second as above    |
|                                    | SKIP), then the second as above     |                                       |
| the rank ended (End message)       | result, backward SKIP "never came"  | the forward `d`                       |
| forward inputs evicted (memory)    | later: backward SKIP naming the cap | unchanged until the backward comes    |
| the server stops (SIGTERM, Ctrl-C) | none                                | unchanged: `h` stays, the spool keeps |
|                                    |                                     | the record for the restart            |
| restart: an `h` record comes back  | none (its details exist)            | unchanged; it waits here again        |
| a collective decided (one rank)    | details + result + collective row   | record `d`                            |
| a record this server does not      | none                                | `d`                                   |
| report (rank or API not wanted)    |                                     |                                       |
| a record cannot be read or decoded | a SKIP row (quarantine)             | `d`                                   |

Restore is its own path (`_restore`): a forward record journaled `h` before a restart is checked again for its
outcome and kept graphs, its rows are not written again, and it waits here as before the restart.

What a waiting call holds has one eviction policy, oldest waiting call first: its forward job (kept for the backward
replay) against `--backward-memory-mb`, for every worker together (never the newest call's: an evicted call still
waits, its backward gets a SKIP row that names the option); its forward replays' autograd graphs (`Graphs`, held by
one worker's replayer) against `--graph-memory-mb` per worker (a call whose graphs were dropped is replayed in full
by its backward, with the same rows).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

from gpu_server.job import CallKey, RecordKey, call_key, record_key
from protos import online_check_pb2 as pb

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
class Graphs:
    """The autograd graphs a forward call's replays kept for its backward replay, held by `owner` (the replayer of
    one worker, gpu_server/replay/sandbox.py: in that process or its worker process)."""

    kept: Any
    nbytes: int
    owner: Any

    def drop(self) -> None:
        self.owner.drop(self.kept)


@dataclasses.dataclass
class Waiting:
    """A forward call waiting for its backward record."""

    record: RecordKey
    outcome: Any                  # the forward's checker.Outcome
    job: Any | None               # the forward job, kept for the backward replay; None once evicted
    nbytes: int = 0
    graphs: Graphs | None = None  # its replays' kept autograd graphs; None when none are (or once dropped)

    @property
    def evicted(self) -> bool:
        return self.job is None


Write = Callable[[Any], None]     # writes a checker.Checked to its rank's reports (raises ReportWriteError)


class PendingCalls:
    """Calls waiting for their backward record, and the records restored from the spool after a restart.
    Thread-safe: every worker shares one; a call is always handled by the worker of its rank."""

    def __init__(self, backward_budget: int, restored: set | frozenset = frozenset(), graph_budget: int = 2 << 30):
        self.budget = backward_budget
        self.graph_budget = graph_budget   # per worker (per replayer)
        self.held = 0
        self._lock = threading.Lock()
        self._waiting: dict[CallKey, Waiting] = {}
        self._jobs: OrderedDict[CallKey, None] = OrderedDict()   # waiting calls whose forward job is kept, oldest first
        self._graphs: dict[Any, OrderedDict[CallKey, None]] = {}   # by replayer: calls with kept graphs, oldest first
        self._graph_bytes: dict[Any, int] = {}
        self.graphs_dropped = 0   # kept graphs dropped before their backward came (the budget): summary.json
        self._restored: set[RecordKey] = {RecordKey(*k) for k in restored}
        self.evictions = 0

    # -- the decisions -----------------------------------------------------------------------------------------
    def check(self, job, checker, write: Write) -> Completion:
        """One job of a rank (on its worker's thread): the checker computes its rows, `write` writes them (raises
        ReportWriteError: nothing further is decided, its records stay in the spool). Returns what to journal."""
        if job.direction == pb.BACKWARD:
            waiting = self.take(job)
            write(checker.backward(job, waiting))
            return self.backward_done(job, waiting)
        keep = job.backward_expected and self.graph_budget > 0
        with self._lock:
            restored = record_key(job) in self._restored
            self._restored.discard(record_key(job))
        if restored:
            return self._restore(job, keep, checker, write)
        forward = checker.forward(job, keep)
        try:
            write(forward.checked)
        except BaseException:
            if forward.graphs is not None:
                forward.graphs.drop()
            raise
        if not job.backward_expected:
            write(checker.result(job, forward.outcome, None, fwd_job=job))
            return Completion(done=[record_key(job)])
        done = self._wait(job, forward, checker, write)
        done.half.append(record_key(job))
        return done

    def _restore(self, job, keep: bool, checker, write: Write) -> Completion:
        """A forward record journaled `h` before a restart: its detail rows exist, so the rows checked now are not
        written and nothing new is journaled for it; checked again only for its outcome and kept graphs, it waits
        for its backward record again, whatever its outcome now (one call, one result row)."""
        forward = checker.forward(job, keep)
        return self._wait(job, forward, checker, write)

    def _wait(self, job, forward, checker, write: Write) -> Completion:
        """The forward call waits for its backward record; a call it displaces (a second forward record of one call)
        gets its result row now."""
        displaced = self.hold(job, forward.outcome, forward.graphs)
        if displaced is None:
            return Completion()
        if displaced.graphs is not None:
            displaced.graphs.drop()
        write(checker.unfinished(call_key(job), displaced,
                                 "a second forward record of this call arrived before its backward record"))
        return Completion(done=[displaced.record])

    def collective(self, finding, verdict, checker, write: Write) -> Completion:
        """One member rank's rows of a collective the matcher decided; its record is then done."""
        write(checker.check_collective(finding, verdict))
        return Completion(done=[record_key(verdict.job)])

    def end_rank(self, run_id: str, rank: int, why: str, checker, write: Write) -> Completion:
        """The rank ended (its End counted): every call still waiting gets its result row now, its backward SKIP."""
        ended = self.rank_ended(run_id, rank)
        for _key, waiting in ended:
            if waiting.graphs is not None:
                waiting.graphs.drop()
        done = Completion()
        for key, waiting in ended:
            write(checker.unfinished(key, waiting, f"backward record never arrived ({why})"))
            done.done.append(waiting.record)
        return done

    def not_reported(self, run_id: str, rank: int, seq: int) -> Completion:
        """A spooled record this server reports nothing for (its rank or API is not wanted now, though an earlier
        configuration spooled it): done at once."""
        key = RecordKey(run_id, int(rank), int(seq))
        with self._lock:
            self._restored.discard(key)
        return Completion(done=[key])

    # -- the books ---------------------------------------------------------------------------------------------
    def is_restored(self, job) -> bool:
        """A forward record journaled `h` before a restart and not handled yet."""
        with self._lock:
            return record_key(job) in self._restored

    def hold(self, job, outcome, graphs: Graphs | None = None) -> Waiting | None:
        """The forward call waits for its backward record (within the budgets). Returns a call it displaces."""
        key, rec = call_key(job), record_key(job)
        with self._lock:
            displaced = self._pop(key)
            self._waiting[key] = Waiting(rec, outcome, job, job.nbytes, graphs)
            self._jobs[key] = None
            self.held += job.nbytes
            if graphs is not None:
                self._graphs.setdefault(graphs.owner, OrderedDict())[key] = None
                self._graph_bytes[graphs.owner] = self._graph_bytes.get(graphs.owner, 0) + graphs.nbytes
                self._evict_graphs(graphs.owner)
            self._evict_jobs()
        return displaced

    def _evict_jobs(self) -> None:
        while self.held > self.budget and len(self._jobs) > 1:
            victim = self._waiting[self._jobs.popitem(last=False)[0]]
            self.held -= victim.nbytes
            victim.job = None
            self.evictions += 1

    def _evict_graphs(self, owner: Any) -> None:
        kept = self._graphs[owner]
        while kept and self._graph_bytes[owner] > self.graph_budget:
            victim = self._waiting[kept.popitem(last=False)[0]]
            self._graph_bytes[owner] -= victim.graphs.nbytes
            victim.graphs.drop()
            victim.graphs = None
            self.graphs_dropped += 1

    def take(self, job) -> Waiting | None:
        """The backward record of a call arrived: the waiting forward (None if none waits)."""
        with self._lock:
            return self._pop(call_key(job))

    def _pop(self, key: CallKey) -> Waiting | None:
        w = self._waiting.pop(key, None)
        if w is None:
            return None
        if key in self._jobs:
            del self._jobs[key]
            self.held -= w.nbytes
        if w.graphs is not None:
            del self._graphs[w.graphs.owner][key]
            self._graph_bytes[w.graphs.owner] -= w.graphs.nbytes
        return w

    @staticmethod
    def backward_done(job, forward: Waiting | None) -> Completion:
        done = [record_key(job)]
        if forward is not None:
            done.append(forward.record)
        return Completion(done=done)

    def rank_ended(self, run_id: str, rank: int) -> list[tuple[CallKey, Waiting]]:
        """Every call of the rank still waiting, no longer waiting."""
        with self._lock:
            keys = [k for k in self._waiting if k.run_id == run_id and k.rank == rank]
            return [(k, self._pop(k)) for k in keys]

    def waiting_count(self) -> int:
        with self._lock:
            return len(self._waiting)

    def stop(self) -> int:
        """The server stops (its workers and their replayers are closed): nothing is reported or journaled for the
        waiting calls, their kept graphs are let go; their forward records stay in the spool (journaled `h`) and a
        restart with the same --out waits for their backward records again."""
        with self._lock:
            for w in self._waiting.values():
                w.graphs = None
            self._graphs.clear()
            self._graph_bytes.clear()
            n = len(self._waiting)
        if n:
            log.warning("%d calls of ranks that have not ended wait for their backward records; they stay in the "
                        "spool and are finished after a restart with the same --out", n)
        return n

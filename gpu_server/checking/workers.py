"""Worker threads: one per bench device (several for CPU when asked), never a fixed count (docs/design.md §6.1).

Jobs of one rank always go to the same worker, in arrival order, so the rows of a rank are written in a
deterministic order by one thread. What waits in the queues is bounded by the server's payload memory budget
(`--memory-mb`, reserved at intake and released when a job is checked), so records are acknowledged as soon as they
are durable and a slow bench pushes back on the transport only once that budget is full.

Each worker is a `Worker`: gpu_server/checking/pending.py's `PendingCalls` (shared by the workers) decides, the worker's
`Checker` computes the rows (values), the worker's `Reports` writes them. After each job the worker tells
`on_complete` which records are now completely reported (`done`), which forward records have their detail rows
written while their result row waits for the backward record (`half`), and the sizes of the rank's report files at
that moment: the durable spool journals exactly that (gpu_server/spool/store.py).

Collectives (a job with `Job.collective`) are never replayed: the workers share one `collectives.Matcher`
(`--collective-memory-mb`), which holds each record until the records of its collective from every member rank are
in (or a member rank ended without it, or the server finishes with every run ended). Nothing is written or journaled
when a collective record arrives: it stays in the spool, and a restart adds it to the matcher again. Each decided
collective (`Finding`) is delivered rank by rank to the worker that writes that rank's rows, which writes them and
journals the record done.
"""
from __future__ import annotations

import gc
import logging
import os
import queue
import threading
from typing import Callable

import torch

from gpu_server.checking.checker import Checked, Checker
from gpu_server.checking.collectives import Matcher
from gpu_server.checking.pending import Completion, PendingCalls
from gpu_server.checking.pooled import PooledErrors
from gpu_server.job import Job
from gpu_server.replay import run as replay
from gpu_server.replay.sandbox import SandboxLimits, make_replayer
from gpu_server.reports.error_data import Evidence
from gpu_server.reports.rank_reports import Reports, ReportWriteError, header_size
from gpu_server.reports.summary import Summary

log = logging.getLogger("gpu_server")
_STOP = object()


def bench_devices(spec: str | None, workers: int | None) -> list[torch.device]:
    """`--device cpu|cuda|cuda:N` (default: every GPU, else CPU); `--workers` CPU workers (default 1)."""
    if spec in (None, "", "auto"):
        if torch.cuda.is_available() and torch.cuda.device_count():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        spec = "cpu"
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: CUDA is not available on this host")
        if dev.index is None:
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: this host has {torch.cuda.device_count()} GPUs")
        return [dev]
    if dev.type != "cpu":
        raise ValueError(f"--device {spec}: supported are cpu, cuda and cuda:N")
    return [dev] * max(1, workers or 1)


class Worker:
    """What one worker thread does with each item: `PendingCalls` decides, the `Checker` computes the rows, `Reports`
    writes them, then the journal learns what is complete (`on_complete`)."""

    def __init__(self, checker: Checker, reports: Reports, pending: PendingCalls,
                 on_complete: Callable[[list, list, dict[str, int]], None] | None = None):
        self.checker = checker
        self.reports = reports
        self.pending = pending
        self.on_complete = on_complete or (lambda done, half, files: None)
        self._sizes: dict[int, dict[str, int]] = {}   # rank -> its report files' sizes after its last completion

    def write(self, checked: Checked) -> None:
        """The rows in the rank's reports, then what the summary learns from them. Raises ReportWriteError."""
        self.reports.write(checked.rank, checked.rows)
        for note in checked.notes:
            note()

    def check(self, job: Job) -> None:
        self._completed(self.pending.check(job, self.checker, self.write), job.rank)

    def collective(self, finding, verdict) -> None:
        self._completed(self.pending.collective(finding, verdict, self.checker, self.write), verdict.job.rank)

    def end_rank(self, run_id: str, rank: int, why: str) -> None:
        self._completed(self.pending.end_rank(run_id, rank, why, self.checker, self.write), rank)

    def _completed(self, completion: Completion, rank: int) -> None:
        files = {}
        for path in self.reports.of(rank).paths:
            try:
                files[path] = os.path.getsize(path)
            except OSError:
                pass
        self._sizes[rank] = files
        try:
            self.on_complete(completion.done, completion.half, files)
        except Exception:  # noqa: BLE001
            log.exception("could not journal completed records")

    def cut_back(self, rank: int) -> None:
        """Cut the rank's report files back to their sizes after its last complete record (no orphan rows); a file
        made since then (the collective CSV) back to its header."""
        sizes = self._sizes.get(rank, {})
        for path in set(sizes) | set(self.reports.of(rank).paths):
            try:
                size = sizes[path] if path in sizes else header_size(path)
                if os.path.getsize(path) > size:
                    os.truncate(path, size)
            except OSError:
                pass

    def close(self) -> None:
        """Close the reports and the replayer. Calls still waiting for their backward record get no result row:
        that is gpu_server/checking/pending.py's decision (they stay in the spool for a restart)."""
        self.reports.close()
        self.checker.close()


_FROZEN = []


def _freeze_start_up() -> None:
    """Once per process: what start-up made (torch's modules, the warm-up, the replayers) lives as long as the
    server; out of the collector's reach, a full collection no longer walks it again and again while records are
    checked."""
    if not _FROZEN:
        _FROZEN.append(True)
        gc.freeze()


class WorkerPool:
    def __init__(self, devices: list[torch.device], out_dir: str, ts: str, summary: Summary,
                 pending: PendingCalls, queue_size: int = 65536,
                 on_complete: Callable[[list, list, dict[str, int]], None] | None = None,
                 release: Callable[[int], None] | None = None, evidence: Evidence | None = None,
                 pooled: PooledErrors | None = None,
                 sandbox: SandboxLimits | None = None, on_quarantine: Callable[[tuple, str], None] | None = None,
                 max_record_bytes: int = 1 << 30, collective_budget: int = 1 << 30):
        self.summary = summary
        self.pending = pending
        self.on_complete = on_complete or (lambda done, half, files: None)
        self.release = release or (lambda n: None)
        limits = sandbox or SandboxLimits()
        if limits.mode != "process":
            # the replays' meta dry runs load torch's meta kernels: before the transport opens (the pool is built
            # first), so that no record waits for them. Replays in worker processes load them there, at their start.
            replay.warm_up()
        self.on_quarantine = on_quarantine or (lambda key, why: None)
        cpu_workers = sum(d.type == "cpu" for d in devices)
        if cpu_workers > 1:
            # torch's intra-op pool is shared by the process: split the cores instead of oversubscribing them, and
            # leave the thread count alone per call (see replay._threads).
            torch.set_num_threads(max(1, replay.usable_cores() // cpu_workers))
            log.info("%d CPU workers, %d torch threads each; CPU same-dtype runs do not match the training's thread "
                     "count", cpu_workers, torch.get_num_threads())
        # each worker's replays run in its own capped worker process (gpu_server/replay/sandbox.py): started now, ready
        # while the transport opens (the first replay waits for it)
        self.replayers = [make_replayer(d, limits, torch.get_num_threads(), max_record_bytes, f"replay-{i}")
                          for i, d in enumerate(devices)]
        self.workers = [Worker(Checker(d, summary, evidence=evidence,
                                       pooled=pooled,   # one PooledErrors shared by every worker (thread-safe)
                                       replayer=r, on_lost=self._lost),
                               Reports(out_dir, ts, summary.add_files), pending, self.on_complete)
                        for d, r in zip(devices, self.replayers)]
        if cpu_workers > 1:
            for worker in self.workers:
                worker.checker.match_threads = False
        # one matcher for every worker: the records of one collective come from ranks routed to different workers
        self.matcher = Matcher(collective_budget)
        self._jobs: dict[tuple[str, int], str] = {}   # (run, rank) -> the training (Collective.job) it belongs to
        self._lock = threading.Lock()
        self._deliveries = 0
        # Unbounded: a worker delivering a collective's verdicts to another worker's queue must never block on it
        # (two workers delivering to each other would wait forever). What the queues hold is bounded by the memory
        # budget (jobs) and the matcher's budget (verdicts); `queue_size` is kept for callers.
        del queue_size
        self.queues: list[queue.Queue] = [queue.Queue() for _ in devices]
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"gpu-server-worker-{i}", daemon=True)
                        for i in range(len(devices))]
        _freeze_start_up()
        for t in self.threads:
            t.start()

    def _lost(self, job: Job, why: str) -> None:
        """A replay cost its worker process: the record is quarantined (journaled at once: a restart never replays
        it) before its SKIP rows are written."""
        self.summary.quarantine(job.rank, job.name, job.step, why)
        try:
            self.on_quarantine((job.run_id, job.rank, job.seq), why)
        except Exception:  # noqa: BLE001 - its SKIP row is written anyway, which ends its spool entry too
            log.exception("could not journal the quarantine of %s", job.name)

    @property
    def replaced(self) -> int:
        """Replay worker processes replaced after a crash, the memory cap or the time limit."""
        return sum(r.replaced for r in self.replayers)

    def _index(self, rank: int) -> int:
        return rank % len(self.queues)

    def submit(self, job: Job) -> None:
        if not self.pending.is_restored(job):
            self.summary.record_received(job.rank)
        self.queues[self._index(job.rank)].put(("job", job))

    def end_rank(self, run_id: str, rank: int, why: str, job: str = "") -> None:
        """The rank ended (its End counted): its calls waiting for a backward record get their result rows, and
        the collectives it never sent are decided (after every record of the rank queued before the End)."""
        self.queues[self._index(rank)].put(("end", (run_id, rank, why, job)))

    def not_reported(self, run_id: str, rank: int, seq: int) -> None:
        """A spooled record this server reports nothing for (its rank or API is not wanted now): journaled done."""
        completion = self.pending.not_reported(run_id, rank, seq)
        self.on_complete(completion.done, completion.half, {})

    def _run(self, i: int) -> None:
        worker, q = self.workers[i], self.queues[i]
        torch.set_grad_enabled(False)
        while True:
            item = q.get()
            if item is _STOP:
                try:
                    worker.close()
                except Exception:  # noqa: BLE001
                    log.exception("worker %d: internal error while closing the reports", i)
                return
            kind, payload = item
            try:
                if kind == "job":
                    self._check(worker, payload)
                elif kind == "verdict":
                    worker.collective(*payload)
                elif kind == "end":
                    run_id, rank, why, job = payload
                    worker.end_rank(run_id, rank, why)
                    job = job or self._jobs.get((run_id, rank), "")
                    if job:
                        self._deliver(self.matcher.rank_ended(job, rank))
                elif kind == "barrier":
                    payload.set()
            except ReportWriteError as exc:
                # Its rows are not (all) written: nothing is journaled, the rows it did write are cut back, the
                # record stays in the spool and a restart with the same --out checks it again.
                rank = (payload.rank if kind == "job" else payload[1].job.rank if kind == "verdict"
                        else payload[1])
                worker.cut_back(rank)
                self.summary.report_failed(rank, str(exc))
            except Exception:  # noqa: BLE001
                log.exception("worker %d: internal error", i)

    def _check(self, worker: Worker, job: Job) -> None:
        if job.collective is not None:
            # never replayed: held by the matcher (within its own budget, so the memory budget is released now)
            # until its collective is decided; nothing is journaled, the record stays in the spool until then
            self.release(job.reserved)
            job.reserved = 0
            with self._lock:
                self._jobs[(job.run_id, job.rank)] = job.collective.job
            self._deliver(self.matcher.add(job))
            return
        try:
            worker.check(job)
        finally:
            self.release(job.reserved)
            job.reserved = 0

    def _deliver(self, findings: list) -> None:
        """Each decided collective, rank by rank, to the worker of that rank (which writes its rows)."""
        for finding in findings:
            for rank in sorted(finding.verdicts):
                verdict = finding.verdicts[rank]
                with self._lock:
                    self._deliveries += 1
                self.queues[self._index(int(verdict.job.rank))].put(("verdict", (finding, verdict)))

    def _settle(self) -> None:
        """Wait until every worker has handled what is queued, including the verdicts they deliver to each other."""
        while True:
            with self._lock:
                before = self._deliveries
            events = []
            for q in self.queues:
                event = threading.Event()
                q.put(("barrier", event))
                events.append(event)
            for event, t in zip(events, self.threads):
                while not event.wait(1.0):
                    if not t.is_alive():
                        return
            with self._lock:
                if self._deliveries == before:
                    return

    def finish_collectives(self) -> int:
        """Every run ended (--exit-when-done): once every queued record is in the matcher, the collectives still
        incomplete are decided (`Matcher.finish`) and their rows written before the reports close. Returns how
        many findings that made."""
        self._settle()
        findings = self.matcher.finish()
        self._deliver(findings)
        return len(findings)

    def drain_and_stop(self) -> None:
        """Check everything already queued, flush and close the reports. Calls still waiting for their backward
        record are left to gpu_server/checking/pending.py (they stay in the spool)."""
        self._settle()   # verdicts one worker delivers to another are written before either stops
        for q in self.queues:
            q.put(_STOP)
        for t in self.threads:
            t.join()
        self.pending.stop()
        left = self.matcher.pending()
        if left:
            log.warning("%d collective records wait for the records of their other ranks; they stay in the spool "
                        "and are matched after a restart with the same --out", left)

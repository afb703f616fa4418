"""Worker threads: one per bench device (several for CPU when asked), never a fixed count (SPEC §5.1).

Jobs of one rank always go to the same worker, in arrival order, so the rows of a rank are written in a
deterministic order by one thread. What waits in the queues is bounded by the server's payload memory budget
(`--memory-mb`, reserved at intake and released when a job is checked), so records are acknowledged as soon as they
are durable and a slow bench pushes back on the transport only once that budget is full.

After each job the worker tells `on_complete` which records are now completely reported (`done`), which forward
records have their detail rows written while their result row waits for the backward record (`half`), and the sizes
of the rank's report files at that moment: the durable spool journals exactly that (gpu_server/spool.py). A job
submitted with `restore=True` (a `half` record replayed after a restart) rebuilds the checker's state without
writing rows: its rows are in the report files already.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable

import torch

from gpu_server.checker import Checker
from gpu_server.intake import Job
from gpu_server.summary import Summary
from protos import online_check_pb2 as pb

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


Key = tuple  # (run_id, rank, seq)


class WorkerPool:
    def __init__(self, devices: list[torch.device], out_dir: str, ts: str, summary: Summary,
                 backward_budget: int, queue_size: int = 65536,
                 on_complete: Callable[[list[Key], list[Key], dict[str, int]], None] | None = None,
                 release: Callable[[int], None] | None = None, error_data_base: str | None = None):
        self.summary = summary
        self.on_complete = on_complete or (lambda done, half, files: None)
        self.release = release or (lambda n: None)
        self.checkers = [Checker(out_dir, ts, d, summary, backward_budget, error_data_base) for d in devices]
        cpu_workers = sum(d.type == "cpu" for d in devices)
        if cpu_workers > 1:
            # torch's intra-op pool is shared by the process: split the cores instead of oversubscribing them, and
            # leave the thread count alone per call (see replay._threads).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cpu_workers))
            for checker in self.checkers:
                checker.match_threads = False
            log.info("%d CPU workers, %d torch threads each; CPU same-dtype runs do not match the training's thread "
                     "count", cpu_workers, torch.get_num_threads())
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=queue_size) for _ in devices]
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"gpu-server-worker-{i}", daemon=True)
                        for i in range(len(devices))]
        self.done_callbacks = []
        for t in self.threads:
            t.start()

    def _index(self, rank: int) -> int:
        return rank % len(self.queues)

    def submit(self, job: Job, restore: bool = False) -> None:
        if not restore:
            self.summary.record_received(job.rank)
        self.queues[self._index(job.rank)].put(("restore" if restore else "job", job))

    def end_rank(self, run_id: str, rank: int, why: str) -> None:
        self.queues[self._index(rank)].put(("end", (run_id, rank, why)))

    def call(self, index: int, fn) -> None:
        """Run `fn(checker)` on worker `index`'s thread, after what is queued before it."""
        self.queues[index].put(("call", fn))

    def _run(self, i: int) -> None:
        checker, q = self.checkers[i], self.queues[i]
        torch.set_grad_enabled(False)
        awaiting: dict[tuple, Key] = {}   # (run, rank, step, name) -> forward record waiting for its backward
        ranks: set[int] = set()
        while True:
            item = q.get()
            if item is _STOP:
                try:
                    checker.close()
                except Exception:  # noqa: BLE001
                    log.exception("worker %d: internal error while closing the reports", i)
                self._completed(checker, list(awaiting.values()), [], ranks)
                return
            kind, payload = item
            try:
                if kind in ("job", "restore"):
                    self._check(checker, payload, kind == "restore", awaiting)
                    ranks.add(payload.rank)
                    if kind == "job":
                        for cb in self.done_callbacks:
                            cb(payload)
                elif kind == "end":
                    run_id, rank, _why = payload
                    checker.flush_run(*payload)
                    done = [awaiting.pop(k) for k in [k for k in awaiting if k[0] == run_id and k[1] == rank]]
                    self._completed(checker, done, [], {rank} & ranks)
                else:
                    payload(checker)
            except Exception:  # noqa: BLE001
                log.exception("worker %d: internal error", i)

    def _check(self, checker: Checker, job: Job, restore: bool, awaiting: dict) -> None:
        try:
            checker.check(job, write_rows=not restore)
        finally:
            self.release(job.reserved)
            job.reserved = 0
        call = (job.run_id, job.rank, job.step, job.name)
        key = (job.run_id, job.rank, job.seq)
        done, half = [], []
        if job.direction != pb.BACKWARD and checker.awaiting_backward(job):
            awaiting[call] = key
            half.append(key)
        else:
            done.append(key)
            if job.direction == pb.BACKWARD and call in awaiting:
                done.append(awaiting.pop(call))
        self._completed(checker, done, [] if restore else half, {job.rank})

    def _completed(self, checker: Checker, done: list, half: list, ranks) -> None:
        files = {}
        for rank in ranks:
            for path in checker.reports(rank).paths:
                try:
                    files[path] = os.path.getsize(path)
                except OSError:
                    pass
        try:
            self.on_complete(done, half, files)
        except Exception:  # noqa: BLE001
            log.exception("could not journal completed records")

    def drain_and_stop(self) -> None:
        """Check everything already queued, flush and close the reports."""
        for q in self.queues:
            q.put(_STOP)
        for t in self.threads:
            t.join()

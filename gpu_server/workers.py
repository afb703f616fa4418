"""Worker threads: one per bench device (several for CPU when asked), never a fixed count (SPEC §5.1).

Jobs of one rank always go to the same worker, in arrival order, so the rows of a rank are written in a
deterministic order by one thread. Queues are bounded: a slow bench pushes back on the transport.
"""
from __future__ import annotations

import logging
import queue
import threading

import torch

from gpu_server.checker import Checker
from gpu_server.intake import Job
from gpu_server.summary import Summary

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


class WorkerPool:
    def __init__(self, devices: list[torch.device], out_dir: str, ts: str, summary: Summary,
                 backward_budget: int, queue_size: int = 256):
        self.summary = summary
        self.checkers = [Checker(out_dir, ts, d, summary, backward_budget) for d in devices]
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=queue_size) for _ in devices]
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"gpu-server-worker-{i}", daemon=True)
                        for i in range(len(devices))]
        self.done_callbacks = []
        for t in self.threads:
            t.start()

    def _index(self, rank: int) -> int:
        return rank % len(self.queues)

    def submit(self, job: Job) -> None:
        self.summary.record_received(job.rank)
        self.queues[self._index(job.rank)].put(("job", job))

    def end_rank(self, run_id: str, rank: int, why: str) -> None:
        self.queues[self._index(rank)].put(("end", (run_id, rank, why)))

    def call(self, index: int, fn) -> None:
        """Run `fn(checker)` on worker `index`'s thread, after what is queued before it."""
        self.queues[index].put(("call", fn))

    def _run(self, i: int) -> None:
        checker, q = self.checkers[i], self.queues[i]
        torch.set_grad_enabled(False)
        while True:
            item = q.get()
            if item is _STOP:
                checker.close()
                return
            kind, payload = item
            try:
                if kind == "job":
                    checker.check(payload)
                    for cb in self.done_callbacks:
                        cb(payload)
                elif kind == "end":
                    checker.flush_run(*payload)
                else:
                    payload(checker)
            except Exception:  # noqa: BLE001
                log.exception("worker %d: internal error", i)

    def drain_and_stop(self) -> None:
        """Check everything already queued, flush and close the reports."""
        for q in self.queues:
            q.put(_STOP)
        for t in self.threads:
            t.join()

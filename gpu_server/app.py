"""The server assembled: transport -> intake -> spool -> workers -> reports, with start, resume, drain and summary.

Start-up with an `--out` that holds a spool (gpu_server/spool.py) resumes the earlier session: the report files
keep their `{ts}` and are cut back to what the journal says is complete, the spooled records that were not
completely reported are handed to the workers before the transport opens, and the (run, rank, seq) already accepted
are remembered, so an agent re-sending after the restart gets DUPLICATE for them and no row is written twice.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from gpu_server.config import ServerConfig
from gpu_server.intake import ByteBudget, Intake
from gpu_server.spool import Spool
from gpu_server.summary import Summary
from gpu_server.workers import WorkerPool, bench_devices
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger("gpu_server")


def default_memory_budget() -> int:
    """A quarter of the host's memory, at least 1 GiB: payloads held at once (assembling, spooled, queued)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 8 << 30
    return max(1 << 30, total // 4)


class ServerApp:
    def __init__(self, config: ServerConfig, out_dir: str, device: str | None = None, workers: int | None = None,
                 limits: Limits = DEFAULT_LIMITS, backward_budget: int = 4 << 30, expected_ranks: int | None = None,
                 memory_budget: int | None = None, fsync: bool = True):
        self.config = config
        self.out_dir = out_dir
        self.limits = limits
        self.summary = Summary()
        self.devices = bench_devices(device, workers)
        self.expected_ranks = expected_ranks
        self.done = threading.Event()
        self._ended: set[int] = set()
        self.budget = ByteBudget(memory_budget or default_memory_budget())
        self.spool = Spool(out_dir, limits, fsync=fsync)
        self.recovery = self.spool.open(time.strftime("%Y%m%d%H%M%S"))
        self.ts = self.recovery.ts
        # error_data_path: relative paths (msprobe's default "./") are taken inside --out
        error_base = os.path.join(out_dir, config.error_data_path) if config.error_data_path else None
        self.pool = WorkerPool(self.devices, out_dir, self.ts, self.summary, backward_budget,
                               on_complete=self.spool.complete, release=self.budget.release,
                               error_data_base=error_base)
        self.intake = Intake(config, self.pool.submit, limits, spool=self.spool, budget=self.budget)
        for run_id, rank, seq in self.spool.seen():
            self.intake.mark_seen(run_id, rank, seq)
        self.server = None
        self.folder = None
        self.bind_target = ""
        self.replayed = 0

    def resume(self) -> None:
        """Hand the spooled records that were not completely reported to the workers (before any transport)."""
        rec = self.recovery
        self.summary.resumed(rec.resumed, rec.starts, len(rec.replay), rec.done_count, rec.truncated)
        if rec.resumed:
            self.summary.seed_from_reports(self.out_dir, self.ts)
            log.info("resuming the session of %s in %s (start %d): %d records completely reported earlier, %d to "
                     "check from the spool%s", self.ts, os.path.abspath(self.out_dir), rec.starts, rec.done_count,
                     len(rec.replay), f", {sum(rec.truncated.values())} bytes of unjournaled rows cut off"
                     if rec.truncated else "")
        for entry in rec.replay:
            self.budget.acquire(entry.payload_len)
            try:
                record, payload = self.spool.read(entry)
            except (OSError, ValueError) as exc:
                self.budget.release(entry.payload_len)
                log.error("spool: cannot read record %s back (%s); it is not checked", entry.key, exc)
                continue
            self.intake.process(record, payload, entry.payload_len, restore=entry.key in rec.half)
            self.replayed += 1
        for end in rec.ends:
            self._apply_end(end, persist=False)

    def start(self) -> None:
        self.resume()
        if self.config.nfs_path:
            from gpu_server.folder import FolderReader

            self.folder = FolderReader(self.config.nfs_path, self.intake, self.limits, self.on_end)
            self.folder.start()
            return
        from gpu_server.service import StreamHandler, make_server

        handler = StreamHandler(self.intake, self.limits, self.on_end, self.budget)
        self.server, port = make_server(handler, self.config.bind_target, self.limits, self.config.tls_path)
        self.bind_target = self.config.bind_target.rsplit(":", 1)[0] + f":{port}"
        self.server.start()

    def on_end(self, end: pb.End) -> None:
        counts = {"run_id": end.run_id, "rank": end.rank, "captured": end.captured, "sent": end.sent,
                  "acknowledged": end.acknowledged, "dropped": end.dropped, "records": end.last_seq}
        if end.sampling:
            counts["sampling"] = dict(sorted(end.sampling.items()))
        self._apply_end(counts, persist=True)

    def _apply_end(self, end: dict, persist: bool) -> None:
        run_id, rank = end["run_id"], int(end["rank"])
        if persist:
            self.spool.record_end(end)   # durable before END_ACCEPTED goes out
        counts = {k: v for k, v in end.items() if k not in ("run_id", "rank")}
        self.summary.rank_ended(run_id, rank, counts)
        if self.config.wants_rank(rank):
            self.pool.end_rank(run_id, rank, "the rank ended")
        if persist:
            log.info("rank %d (run %s) ended: captured %d, sent %d, dropped %d", rank, run_id,
                     end.get("captured", 0), end.get("sent", 0), end.get("dropped", 0))
        self._ended.add(rank)
        if self.expected_ranks and len(self._ended) >= self.expected_ranks:
            self.done.set()

    def shutdown(self) -> None:
        """Stop accepting: no new streams or records; what was acknowledged is still checked."""
        if self.server is not None:
            self.server.stop(grace=2.0).wait()
        if self.folder is not None:
            self.folder.stop()

    def finish(self) -> list[str]:
        for name in ("duplicates", "rejected", "filtered"):
            self.summary.count(name, getattr(self.intake, name))
        self.summary.count("spool_replayed", self.replayed)
        self.spool.flush()
        self.pool.drain_and_stop()
        self.spool.close()
        self.summary.count("spool_left", self.spool.live_records())
        self.summary.set_memory(self.budget.limit, self.budget.peak)
        path = self.summary.write_json(self.out_dir, self.ts)
        files = [p for paths in self.summary.files.values() for p in paths]
        return files + [path]

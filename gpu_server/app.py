"""The server assembled: transport -> intake -> workers -> reports, with start, drain and summary."""
from __future__ import annotations

import logging
import threading
import time

from gpu_server.config import ServerConfig
from gpu_server.intake import Intake
from gpu_server.summary import Summary
from gpu_server.workers import WorkerPool, bench_devices
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger("gpu_server")


class ServerApp:
    def __init__(self, config: ServerConfig, out_dir: str, device: str | None = None, workers: int | None = None,
                 limits: Limits = DEFAULT_LIMITS, backward_budget: int = 4 << 30, expected_ranks: int | None = None):
        self.config = config
        self.out_dir = out_dir
        self.limits = limits
        self.ts = time.strftime("%Y%m%d%H%M%S")
        self.summary = Summary()
        self.devices = bench_devices(device, workers)
        self.expected_ranks = expected_ranks
        self.done = threading.Event()
        self._ended: set[int] = set()
        self.pool = WorkerPool(self.devices, out_dir, self.ts, self.summary, backward_budget)
        self.intake = Intake(config, self.pool.submit, limits)
        self.server = None
        self.folder = None
        self.bind_target = ""

    def start(self) -> None:
        if self.config.nfs_path:
            from gpu_server.folder import FolderReader

            self.folder = FolderReader(self.config.nfs_path, self.intake, self.limits, self.on_end)
            self.folder.start()
            return
        from gpu_server.service import StreamHandler, make_server

        handler = StreamHandler(self.intake, self.limits, self.on_end)
        self.server, port = make_server(handler, self.config.bind_target, self.limits, self.config.tls_path)
        self.bind_target = self.config.bind_target.rsplit(":", 1)[0] + f":{port}"
        self.server.start()

    def on_end(self, end: pb.End) -> None:
        counts = {"captured": end.captured, "sent": end.sent, "acknowledged": end.acknowledged,
                  "dropped": end.dropped, "records": end.last_seq}
        self.summary.rank_ended(end.run_id, end.rank, counts)
        if self.config.wants_rank(end.rank):
            self.pool.end_rank(end.run_id, end.rank, "the rank ended")
        log.info("rank %d (run %s) ended: captured %d, sent %d, dropped %d", end.rank, end.run_id, end.captured,
                 end.sent, end.dropped)
        self._ended.add(end.rank)
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
        self.pool.drain_and_stop()
        path = self.summary.write_json(self.out_dir, self.ts)
        files = [p for paths in self.summary.files.values() for p in paths]
        return files + [path]

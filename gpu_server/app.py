"""The server assembled: transport -> intake -> spool -> workers -> reports, with start, resume, drain and summary.

Start-up with an `--out` that holds a spool (gpu_server/spool/store.py) resumes the earlier session: the report files
keep their `{ts}` and are cut back to what the journal says is complete, the spooled records that were not
completely reported are handed to the workers before the transport opens, and the (run, rank, seq) already accepted
are remembered, so an agent re-sending after the restart gets DUPLICATE for them and no row is written twice.
A spooled record that cannot be read back or decoded is quarantined with a SKIP row: one record never stops a
restart. What a call's records may journal, on every path, is decided by gpu_server/checking/pending.py.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from gpu_server import disk
from gpu_server.checking.pending import PendingCalls
from gpu_server.checking.pooled import DEFAULT_FAIL_ABOVE_ULP, PooledErrors
from gpu_server.checking.workers import WorkerPool, bench_devices
from gpu_server.config import ServerConfig
from gpu_server.intake.admission import Intake
from gpu_server.intake.budget import ByteBudget, check_peak
from gpu_server.intake.payload_pool import PAYLOADS
from gpu_server.intake.stream import RecordSource
from gpu_server.job import Job
from gpu_server.replay.registry import known
from gpu_server.replay.sandbox import SandboxLimits, host_memory
from gpu_server.reports.cpu_use import CpuUse
from gpu_server.reports.error_data import Evidence
from gpu_server.reports.rank_reports import OPEN_FILES
from gpu_server.reports.summary import Summary
from gpu_server.spool.store import Entry, Spool
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS, RUN_ID, Limits, log_text

log = logging.getLogger("gpu_server")


def default_memory_budget() -> int:
    """A quarter of the host's memory, at least 1 GiB: payloads held at once (assembling, spooled, queued)."""
    return max(1 << 30, host_memory(8 << 30) // 4)


class ServerApp:
    def __init__(self, config: ServerConfig, out_dir: str, device: str | None = None, workers: int | None = None,
                 limits: Limits = DEFAULT_LIMITS, backward_budget: int = 4 << 30, expected_ranks: int | None = None,
                 memory_budget: int | None = None, fsync: bool = True, error_data_max_bytes: int | None = None,
                 keep_records: bool = False, graph_budget: int = 2 << 30,
                 bias_fail_ulp: float = DEFAULT_FAIL_ABOVE_ULP, replay_in: str = "process",
                 replay_timeout_s: float = 120.0, replay_memory: int | None = None, world_size: int | None = None,
                 collective_budget: int = 1 << 30, extensions: str | None = None):
        if extensions:   # before anything replays: the references, post-processing and judging it names
            from gpu_server.replay import extensions as ext

            loaded = ext.load(extensions)   # ExtensionError (a ValueError): one line per problem
            log.info("extension file %s: %d references (%s), %d post-processed APIs, %d per-API judgings",
                     loaded.path, len(loaded.references), ", ".join(loaded.references) or "none",
                     len(loaded.postprocess), len(loaded.judging))
        self.cpu_use = CpuUse().start()   # where the server's CPU goes (summary.json cpu_s), from its set-up on
        self.config = config
        self.out_dir = out_dir
        self.limits = limits
        self.summary = Summary()
        # judging across calls (gpu_server/checking/pooled.py): one accumulator for every worker, in the summary as
        # api_bias
        self.pooled = PooledErrors(fail_above_ulp=bias_fail_ulp)
        self.summary.pooled = self.pooled
        self.devices = bench_devices(device, workers)
        self.expected_ranks = expected_ranks
        self.done = threading.Event()
        disk.stopping.clear()
        # ends that counted, by (run, rank); --exit-when-done needs expected_ranks of them and no other rank that
        # sent records still connected (ServerApp._check_done)
        self._ended: set[tuple[str, int]] = set()
        self._waiting_logged: frozenset[tuple[str, int]] = frozenset()
        self.world_size = world_size
        self.budget = ByteBudget(memory_budget or default_memory_budget())
        self.spool = Spool(out_dir, limits, fsync=fsync, keep=keep_records)   # keep: for `gpu-server recheck`
        self.recovery = self.spool.open(time.strftime("%Y%m%d%H%M%S"))
        self.ts = self.recovery.ts
        self.summary.backlog = self.spool.live_records   # records/s, backlog and time to drain in the progress line
        # error_data_path: relative paths (msprobe's default "./") are taken inside --out
        error_base = os.path.join(out_dir, config.error_data_path) if config.error_data_path else None
        self.evidence = Evidence(error_base, self.ts, error_data_max_bytes) if error_base else None
        # the one owner of each call's lifecycle: what waits (and what it holds: forward jobs, kept graphs),
        # what is restored, what the journal says
        self.pending = PendingCalls(backward_budget, restored=self.recovery.half, graph_budget=graph_budget)
        self.pool = WorkerPool(self.devices, out_dir, self.ts, self.summary, self.pending,
                               on_complete=self.spool.complete, release=self.budget.release, evidence=self.evidence,
                               pooled=self.pooled,
                               sandbox=SandboxLimits(replay_in, replay_timeout_s, replay_memory),
                               on_quarantine=self.spool.quarantine, max_record_bytes=limits.max_record_bytes,
                               collective_budget=collective_budget)
        self.intake = Intake(config, self.pool.submit, limits, spool=self.spool, budget=self.budget,
                             world_size=world_size, not_reported=self.pool.not_reported)
        self.intake.on_closed = self._check_done
        for run_id, rank, seq in self.spool.seen():
            self.intake.mark_seen(run_id, rank, seq)
        self.source: RecordSource | None = None
        self.bind_target = ""
        self.replayed = 0
        self.quarantined = 0

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
        if rec.journal_damaged:
            self.summary.set_durability(journal_damaged=rec.journal_damaged,
                                        spool_records_found_in_reports=rec.rebuilt)
        if rec.damage:
            self.summary.set_durability(spool_damaged_regions=len(rec.damage),
                                        spool_damaged_bytes=sum(d.skipped for d in rec.damage))
        for entry in rec.replay:
            if entry.key in rec.quarantined:   # its replay cost a worker process: never replayed again
                self._quarantine(entry, f"its replay killed a replay worker before the restart "
                                        f"({rec.quarantined[entry.key]})", replayable=False)
                continue
            self.budget.acquire(entry.payload_len)
            try:
                record, payload = self.spool.read(entry)
            except (OSError, ValueError) as exc:
                self.budget.release(entry.payload_len)
                self._quarantine(entry, f"the spooled record cannot be read back ({exc})")
                continue
            # held until it is checked: its estimated peak, as for a record off the wire
            # (gpu_server/intake/budget.py)
            peak = max(entry.payload_len, check_peak(record, entry.payload_len))
            self.budget.acquire(peak - entry.payload_len, own=entry.payload_len)
            try:
                self.intake.process(record, payload, peak)
            except Exception as exc:  # noqa: BLE001 - one spooled record never stops a restart
                self._quarantine(entry, f"the spooled record fails to load ({type(exc).__name__}: {exc})")
                continue
            self.replayed += 1
        for end in rec.ends:
            self._apply_end(end, persist=False)

    def _quarantine(self, entry: Entry, why: str, replayable: bool = True) -> None:
        """A spooled record that cannot be read back or decoded: a SKIP row says so (and its entry is done)."""
        self.quarantined += 1
        run_id, rank, seq = entry.key
        name = entry.name
        parts = name.split(".")
        category, api = (parts[0], ".".join(parts[1:-1])) if len(parts) >= 3 else ("", "")
        log.error("spool: %s (rank %d, step %d, seq %d) is quarantined: %s; it gets a SKIP row", name or "a record",
                  rank, entry.step, seq, why)
        self.summary.quarantine(rank, name, entry.step, why)
        job = Job(run_id=run_id, rank=rank, step=entry.step, seq=seq, name=name or f"invalid.record.{seq}",
                  category=category, api=api, direction=entry.direction or pb.FORWARD,
                  skip_reason=f"quarantined at restart: {why}")
        if replayable and category and known(category, api) is not None:
            job.skip_reason += " (and the API is not replayable)"
        self.pool.submit(job)

    def start(self) -> None:
        self.resume()
        self.source = self._source()
        self.bind_target = self.source.start()

    def _source(self) -> RecordSource:
        """The transport: the shared-folder reader with run_ut.nfs_path, else the gRPC service."""
        if self.config.nfs_path:
            from gpu_server.intake.folder import FolderReader

            return FolderReader(self.config.nfs_path, self.intake, self.limits, self.on_end)
        from gpu_server.intake.grpc_service import StreamHandler, make_server

        handler = StreamHandler(self.intake, self.limits, self.on_end, self.budget)
        return make_server(handler, self.config.bind_target, self.limits, self.config.tls_path)

    def on_end(self, end: pb.End) -> None:
        counts = {"run_id": end.run_id, "rank": end.rank, "captured": end.captured, "sent": end.sent,
                  "acknowledged": end.acknowledged, "dropped": end.dropped, "records": end.last_seq}
        if end.job and RUN_ID.match(end.job):   # the training it belongs to (Collective.job): its collectives
            counts["job"] = end.job
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
            self.pool.end_rank(run_id, rank, "the rank ended", job=str(end.get("job", "")))
        if persist:
            log.info("rank %d (run %s) ended: captured %d, sent %d, dropped %d", rank, run_id,
                     end.get("captured", 0), end.get("sent", 0), end.get("dropped", 0))
        if self._counts(rank):
            self._ended.add((run_id, rank))
        self._check_done()

    def _counts(self, rank: int) -> bool:
        """Whether a rank counts toward --exit-when-done: one this server reports, below --world-size."""
        return self.config.wants_rank(rank) and (self.world_size is None or rank < self.world_size)

    def _check_done(self) -> None:
        """--exit-when-done: done once `expected_ranks` distinct ranks have ended (each end counted only from the
        connection or certificate that sent its records, Intake.end_backed) and no other (run, rank) that sent
        records is still connected: a client ending its own ranks cannot stop the server while a training runs."""
        if not self.expected_ranks or self.done.is_set():
            return
        if len({rank for _, rank in self._ended}) < self.expected_ranks:
            return
        running = frozenset(key for key in self.intake.connected_keys()
                            if key not in self._ended and self._counts(key[1]))
        if running:
            if running != self._waiting_logged:
                self._waiting_logged = running
                shown = ", ".join(f"run {log_text(r, 64)} rank {k}" for r, k in sorted(running)[:5])
                log.info("%d ranks have ended; still waiting for %d connected rank(s) that sent records (%s%s)",
                         len({rank for _, rank in self._ended}), len(running), shown,
                         ", ..." if len(running) > 5 else "")
            return
        self.done.set()

    def shutdown(self) -> None:
        """Stop accepting: no new streams or records; what was acknowledged is still checked. The shared folder's
        reader first reads every complete record file already there (the agent counted them delivered:
        FolderReader.sweep), so they are reported in this run."""
        if self.source is not None:
            self.source.shutdown()

    def finish(self) -> list[str]:
        for name in ("duplicates", "rejected", "not_replayable", "filtered", "refused_ranks"):
            self.summary.count(name, getattr(self.intake, name))
        if self.budget.overdrawn:   # half-received records alone filled the budget: the oldest went on beyond it
            self.summary.count("memory_budget_overdrawn", self.budget.overdrawn)
        for name, n in (self.source.counts() if self.source is not None else {}).items():
            self.summary.count(name, n)
        self.summary.count("spool_replayed", self.replayed)
        self.summary.count("spool_quarantined", self.quarantined)
        if self.done.is_set():
            # every run ended (--exit-when-done): the collectives still incomplete are decided now, before the
            # reports close (on a stop without every run ended they stay in the spool for a restart)
            self.pool.finish_collectives()
        disk.stopping.set()
        self.spool.flush()
        self.pool.drain_and_stop()
        self.summary.count("replay_workers_replaced", self.pool.replaced)
        self.spool.close()
        self.summary.count("spool_left", self.spool.live_records())
        if self.spool.keep:   # --keep-records: what the kept records cost on disk (spool/kept/, all starts)
            segments, size = self.spool.kept_usage()
            self.summary.set_durability(spool_kept_segments=segments, spool_kept_bytes=size)
        self.summary.set_durability(
            calls_waiting_for_backward_kept_in_spool=self.pending.waiting_count(),
            collective_records_waiting_kept_in_spool=self.pool.matcher.pending(),
            forward_inputs_evicted=self.pending.evictions,
            error_data_saved=self.evidence.saved if self.evidence else 0,
            error_data_not_saved=self.evidence.skipped if self.evidence else 0,
            disk_full_waits=disk.full_events, report_file_opens=OPEN_FILES.reopened)
        self.summary.set_memory(self.budget.limit, self.budget.peak, PAYLOADS.reused)
        self.summary.set_graphs_dropped(self.pending.graphs_dropped)
        bias = self._api_bias_csv()
        self.summary.pooled = self.pooled
        self.cpu_use.stop()   # the replay workers were stopped and waited for above (pool.drain_and_stop)
        self.summary.cpu = self.cpu_use.as_dict()
        path = self.summary.write_json(self.out_dir, self.ts)
        files = [p for paths in self.summary.files.values() for p in paths]
        return files + [path] + bias + self._html_report()

    def _api_bias_csv(self) -> list[str]:
        """api_bias_{ts}.csv, the pooled statistics across calls (gpu_server/checking/pooled.py); never fails the
        drain."""
        try:
            return [self.pooled.write_csv(self.out_dir, self.ts)]
        except Exception as exc:  # noqa: BLE001 - the per-call reports are complete without it
            log.warning("the pooled statistics (api_bias CSV) could not be written: %s", exc)
            return []

    def _html_report(self) -> list[str]:
        """The HTML report next to the CSVs (gpu_server/reports/html.py); never fails the drain."""
        try:
            from gpu_server.reports.html import write_html

            return [write_html(self.out_dir)] if self.summary.files else []
        except Exception as exc:  # noqa: BLE001 - the CSV reports are complete; the HTML one is a view of them
            log.warning("the HTML report could not be written: %s", exc)
            return []

"""Counts for the live progress line, the end-of-run summary and summary.json (docs/design.md §6.1, §6.6)."""
from __future__ import annotations

import collections
import csv
import json
import logging
import os
import threading
import time
from typing import Callable

from gpu_server import report_files
from gpu_server.atomic_file import write_atomic
from gpu_server.drain_rate import DrainRate
from gpu_server.standards import standard_labels
from gpu_server.standards.registry import ERROR, SKIP, STATUSES

log = logging.getLogger("gpu_server")

# msprobe's algorithm names (the 比对算法 column) and how the summary calls them: the standards' registry's
STANDARD_NAMES = standard_labels()


class Summary:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.received: collections.Counter = collections.Counter()     # per rank
        self.checked: collections.Counter = collections.Counter()      # calls with a result row, per rank
        self.failed: collections.Counter = collections.Counter()       # calls with an error, per rank
        self.result_status: collections.Counter = collections.Counter()
        self.precision_status: collections.Counter = collections.Counter()
        self.by_standard: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.failing: collections.Counter = collections.Counter()       # bare API -> failed calls
        self.failing_examples: dict[str, list] = collections.defaultdict(list)  # bare API -> up to 3 examples
        self.ends: dict[tuple[str, int], dict] = {}
        self.files: dict[int, list[str]] = {}
        self.transport: dict[str, int] = collections.Counter()
        self.session: dict = {"resumed": False, "server_starts": 1}
        self.memory: dict = {}
        self.backlog: Callable[[], int] | None = None   # records waiting (the app sets it): rates in the progress line
        self._drain = DrainRate()
        self.report_failures: collections.Counter = collections.Counter()   # per rank: rows that could not be written
        self.report_failure_examples: list[str] = []
        self.quarantined: list[dict] = []      # spooled records that could not be read back or decoded
        self.durability: dict = {}

    def add_files(self, rank: int, paths: list[str]) -> None:
        with self._lock:
            self.files[rank] = paths

    def report_failed(self, rank: int, message: str) -> None:
        """Rows of a record could not be written (it stays in the spool): the summary and exit status say so."""
        with self._lock:
            first = not self.report_failures
            self.report_failures[rank] += 1
            if len(self.report_failure_examples) < 5:
                self.report_failure_examples.append(f"rank {rank}: {message}")
        if first:
            log.error("report rows of rank %d could not be written (%s); those records stay in the spool: fix the "
                      "cause and restart with the same --out (later failures are counted in the summary)",
                      rank, message)

    def quarantine(self, rank: int, name: str, step: int, why: str) -> None:
        with self._lock:
            self.quarantined.append({"rank": rank, "call": name, "step": step, "why": why})

    def set_durability(self, **counts) -> None:
        with self._lock:
            self.durability.update(counts)

    def record_received(self, rank: int) -> None:
        with self._lock:
            self.received[rank] += 1

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.transport[key] += n

    def call_done(self, rank: int, name: str, fwd: str, bwd: str, pfwd: str, pbwd: str, message: str) -> None:
        with self._lock:
            self.checked[rank] += 1
            for s in (fwd, bwd):
                if s.strip():
                    self.result_status[s] += 1
            for s in (pfwd, pbwd):
                if s.strip():
                    self.precision_status[s] += 1
            if ERROR in (fwd, bwd, pfwd, pbwd):
                self.failed[rank] += 1
                api = ".".join(name.split(".")[:2])
                self.failing[api] += 1
                if len(self.failing_examples[api]) < 3:     # bounded, however many calls fail
                    self.failing_examples[api].append((rank, name, message))

    def standard_row(self, algorithm: str, status: str) -> None:
        """One api_precision_compare details row: counted per standard and status."""
        name = STANDARD_NAMES.get(algorithm.strip(), "none (SKIP or mismatch)")
        with self._lock:
            self.by_standard[name][status] += 1

    def resumed(self, resumed: bool, starts: int, replay: int, done: int, truncated: dict) -> None:
        with self._lock:
            self.session = {"resumed": resumed, "server_starts": starts, "records_reported_before": done,
                            "spool_records_at_start": replay, "unjournaled_bytes_cut": sum(truncated.values())}

    def set_memory(self, budget: int, peak: int) -> None:
        with self._lock:
            self.memory = {"payload_budget_bytes": budget, "payload_peak_bytes": peak}

    def seed_from_reports(self, out_dir: str, ts: str) -> None:
        """A resumed session: count the result rows the earlier server processes wrote (after the cut-back)."""
        for name, (kind, rank) in sorted(report_files.session_reports(out_dir, ts).items()):
            if kind != report_files.RESULT:
                continue
            path = os.path.join(out_dir, name)
            precision = report_files.path(out_dir, report_files.PRECISION_RESULT, ts, rank)
            try:
                with open(path, encoding="utf-8-sig", newline="") as fh:
                    rows = list(csv.reader(fh))[1:]
                prows = []
                if os.path.exists(precision):
                    with open(precision, encoding="utf-8-sig", newline="") as fh:
                        prows = list(csv.reader(fh))[1:]
            except (OSError, csv.Error, UnicodeDecodeError):
                continue
            pmap = {r[0]: r for r in prows if len(r) >= 4}
            pdetails = report_files.path(out_dir, report_files.PRECISION_DETAILS, ts, rank)
            if os.path.exists(pdetails):
                try:
                    with open(pdetails, encoding="utf-8-sig", newline="") as fh:
                        for row in csv.DictReader(fh):
                            self.standard_row(row.get("比对算法") or " ", row.get("比对结果") or SKIP)
                except (OSError, csv.Error):
                    pass
            for r in rows:
                if len(r) < 4:
                    continue
                p = pmap.get(r[0], [r[0], " ", " ", ""])
                self.call_done(rank, r[0], r[1], r[2], p[1], p[2], p[3] or r[3])
            with self._lock:
                self.files.setdefault(rank, report_files.rank_paths(out_dir, ts, rank))

    def rank_ended(self, run_id: str, rank: int, counts: dict) -> None:
        with self._lock:
            self.ends[(run_id, rank)] = counts

    def progress_line(self) -> str:
        with self._lock:
            ranks = sorted(set(self.received) | set(self.checked))
            per = " ".join(f"r{r}:{self.received[r]}/{self.checked[r]}/{self.failed[r]}" for r in ranks)
            line = (f"received {sum(self.received.values())}, checked {sum(self.checked.values())}, "
                    f"failed {sum(self.failed.values())} calls")
            line += f"  [rank:recv/checked/failed {per}]" if per else ""
            received = sum(self.received.values())
        return line + ("; " + self._drain.line(received, self.backlog()) if self.backlog else "")

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "elapsed_s": round(time.time() - self.started, 3),
                "records_received": dict(self.received), "calls_checked": dict(self.checked),
                "calls_failed": dict(self.failed),
                "accuracy_checking_status": dict(self.result_status),
                "api_precision_compare_status": dict(self.precision_status),
                "api_precision_compare_rows_by_standard": {k: dict(v) for k, v in sorted(self.by_standard.items())},
                "failing_apis": {api: {"calls": n, "examples": [{"rank": r, "call": c, "message": m}
                                                                 for r, c, m in self.failing_examples[api]]}
                                 for api, n in sorted(self.failing.items(), key=lambda kv: -kv[1])},
                "ranks_ended": [{"run_id": rid, "rank": rk, **c} for (rid, rk), c in self.ends.items()],
                "records_dropped_by_agents": sum(int(c.get("dropped", 0)) for c in self.ends.values()),
                "session": dict(self.session),
                "memory": dict(self.memory),
                "transport": dict(self.transport),
                "report_files": {str(k): v for k, v in self.files.items()},
                "report_write_failures": {"records": sum(self.report_failures.values()),
                                          "by_rank": {str(k): v for k, v in sorted(self.report_failures.items())},
                                          "examples": list(self.report_failure_examples)},
                "quarantined_records": list(self.quarantined),
                "durability": dict(self.durability),
            }

    def write_json(self, out_dir: str, ts: str) -> str:
        path = report_files.summary_path(out_dir, ts)
        data = self.as_dict()
        write_atomic(path, lambda fh: json.dump(data, fh, indent=2, ensure_ascii=False))
        return path

    def human(self) -> str:
        d = self.as_dict()
        lines = [f"gpu-server summary: {sum(d['records_received'].values())} records received, "
                 f"{sum(d['calls_checked'].values())} API calls checked, {sum(d['calls_failed'].values())} failed "
                 f"({d['elapsed_s']:.1f} s)"]
        lines.append("  accuracy_checking (two-way):    " + _counts(d["accuracy_checking_status"]))
        lines.append("  api_precision_compare (standards): " + _counts(d["api_precision_compare_status"]))
        for name, counts in d["api_precision_compare_rows_by_standard"].items():
            lines.append(f"    {name:24s} rows: " + _counts(counts))
        for k in ("duplicates", "rejected", "filtered", "spool_replayed"):
            if d["transport"].get(k):
                lines.append(f"  {k.replace('_', ' ')} records: {d['transport'][k]}")
        if d["session"].get("resumed"):
            lines.append(f"  resumed session (server start {d['session']['server_starts']}): "
                         f"{d['session']['records_reported_before']} records reported by earlier starts")
        if d["quarantined_records"]:
            lines.append(f"  quarantined spool records (SKIP rows): {len(d['quarantined_records'])}, e.g. "
                         f"{d['quarantined_records'][0]['call']}: {d['quarantined_records'][0]['why'][:160]}")
        for key, value in d["durability"].items():
            if value:
                lines.append(f"  {key.replace('_', ' ')}: {value}")
        failures = d["report_write_failures"]
        if failures["records"]:
            lines.append(f"  REPORT ROWS NOT WRITTEN for {failures['records']} records (kept in the spool; restart "
                         f"with the same --out once fixed): {failures['examples'][0]}")
        if d["records_dropped_by_agents"]:
            lines.append(f"  dropped by the agents (policy 'drop'): {d['records_dropped_by_agents']} records")
        for end in d["ranks_ended"]:
            lines.append(f"  rank {end['rank']} (run {end['run_id']}): captured {end.get('captured', 0)}, sent "
                         f"{end.get('sent', 0)}, dropped {end.get('dropped', 0)} by the agent")
            if end.get("sampling"):
                lines.append("    sampling: " + ", ".join(f"{k} {v}" for k, v in end["sampling"].items()))
        if d["failing_apis"]:
            lines.append("  failing APIs (worst first):")
            for api, info in list(d["failing_apis"].items())[:10]:
                ex = info["examples"][0]
                lines.append(f"    {api}: {info['calls']} calls, e.g. {ex['call']} (rank {ex['rank']}): "
                             f"{ex['message'][:160]}")
        return "\n".join(lines)


def _counts(c: dict) -> str:
    return ", ".join(f"{s} {c.get(s, 0)}" for s in STATUSES)

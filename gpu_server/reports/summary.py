"""Counts for the live progress line, the end-of-run summary and summary.json (docs/design.md §6.1, §6.6)."""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Callable

from gpu_server.atomic_file import write_atomic
from gpu_server.judging.standards import standard_labels
from gpu_server.reports import files as report_files
from gpu_server.reports.drain_rate import DrainRate
from gpu_server.safe_open import FileRefused, csv_rows
from gpu_server.statuses import ERROR, SKIP, STATUSES, WARNING
from protos.limits import call_api

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
        # backward replays on their forward's kept graphs, and those that ran the forward again (none was kept, or
        # it was dropped for --graph-memory-mb: `graphs_dropped`)
        self.graphs: dict[str, int] = {"backward_replays_on_kept_graphs": 0, "backward_replays_forward_again": 0,
                                       "kept_graphs_dropped_for_memory": 0}
        self.backlog: Callable[[], int] | None = None   # records waiting (the app sets it): rates in the progress line
        self._drain = DrainRate()
        self.report_failures: collections.Counter = collections.Counter()   # per rank: rows that could not be written
        self.report_failure_examples: list[str] = []
        self.quarantined: list[dict] = []      # spooled records that could not be read back or decoded
        self.durability: dict = {}
        self.first_anomaly: dict[int, dict] = {}       # per rank: the failing output row with the smallest seq
        self._step_start: dict[tuple[int, int], int] = {}   # (rank, step) -> smallest seq of a row seen
        self.nonfinite_origin: dict[int, dict] = {}    # per rank: the first call making inf/NaN from finite inputs
        self.nonfinite_input: dict[int, dict] = {}     # per rank: the first call receiving inf/NaN
        self.modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.pooled = None     # gpu_server.checking.pooled.PooledErrors of the run (the app sets it): "api_bias"
        self.evidence: dict[tuple[int, str, int], str] = {}   # (rank, call, step) -> its error_data folder
        self.collectives = CollectiveCounts()   # the collectives checked across ranks (collective CSV rows)
        self.cpu: dict | None = None   # where the server's CPU went (gpu_server/reports/cpu_use.py; the app sets it)

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

    def row_done(self, rank: int, step: int, seq: int | None, row: str, status: str, report: str, message: str,
                 module: str = "", source: str = "") -> None:
        """One details row (either report). Keeps where each step starts on each rank and the first failing row
        in execution order (the agent's seq: forward calls in order, then the backward records)."""
        if seq is None:
            return
        with self._lock:
            key = (rank, step)
            if seq < self._step_start.get(key, seq + 1):
                self._step_start[key] = seq
            if status != ERROR:
                return
            first = self.first_anomaly.get(rank)
            if first is not None and (first["seq"], first["report"] != "accuracy_checking") <= (
                    seq, report != "accuracy_checking"):
                return
            call, direction = report_files.split_row_name(row) or (row, "")
            self.first_anomaly[rank] = {
                "rank": rank, "call": call, "row": row, "step": step, "seq": seq,
                "direction": direction, "module": module, "source": source,
                "report": report, "status": status, "message": message[:500]}

    def evidence_saved(self, rank: int, call: str, step: int, folder: str) -> None:
        """A failing call's error-data folder (gpu_server/reports/error_data.py): the first anomaly links to its own."""
        with self._lock:
            if len(self.evidence) < 100_000:
                self.evidence[(rank, call, step)] = os.path.normpath(folder)

    def nonfinite(self, rank: int, step: int, seq: int, name: str, direction: str, module: str, source: str,
                  inputs_finite: bool, device: bool, bench: bool) -> None:
        """One replayed call's finiteness (gpu_server/judging/nonfinite.py): keeps per rank the first origin of inf/NaN
        (finite inputs, non-finite outputs) and the first call that received inf/NaN."""
        entry = {"rank": rank, "call": name, "step": step, "seq": seq, "direction": direction, "module": module,
                 "source": source, "device": device, "bench": bench}
        if inputs_finite and not (device or bench):
            return
        kept = self.nonfinite_origin if inputs_finite else self.nonfinite_input
        with self._lock:
            first = kept.get(rank)
            if first is None or seq < first["seq"]:
                kept[rank] = entry

    def failed_run(self) -> bool:
        """`--fail-on error`: some call failed, or a pooled finding across calls is above the user's limit."""
        with self._lock:
            if sum(self.failed.values()):
                return True
        bias = self.pooled.as_dict() if self.pooled is not None else None
        return any(f.get("verdict") == ERROR for f in (bias or {}).get("findings", ()))

    def _position(self, entry: dict) -> tuple[int, int]:
        """(step, position within the step on its rank): ranks running one program compare by this."""
        return entry["step"], entry["seq"] - self._step_start.get((entry["rank"], entry["step"]), entry["seq"])

    def _first_anomaly(self) -> dict:
        def entry(e: dict) -> dict:
            return {**e, "evidence": self.evidence.get((e["rank"], e["call"], e["step"]), "")}

        by_rank = {str(r): entry(e) for r, e in sorted(self.first_anomaly.items())}
        earliest = min(self.first_anomaly.values(), key=lambda e: (*self._position(e), e["rank"]), default=None)
        return {"earliest": entry(earliest) if earliest else None, "by_rank": by_rank}

    def _nonfinite(self) -> dict:
        from gpu_server.judging.nonfinite import CallFiniteness

        ranks = sorted(set(self.nonfinite_origin) | set(self.nonfinite_input))
        by_rank = {str(r): {"origin": self.nonfinite_origin.get(r), "first_input": self.nonfinite_input.get(r)}
                   for r in ranks}
        origin = min(self.nonfinite_origin.values(), key=lambda e: (*self._position(e), e["rank"]), default=None)
        first_input = min(self.nonfinite_input.values(), key=lambda e: (*self._position(e), e["rank"]),
                          default=None)
        if origin is not None:
            verdict = (f"first inf/NaN made by {origin['call']} (rank {origin['rank']}, step {origin['step']}): "
                       + CallFiniteness(True, origin["device"], origin["bench"]).verdict())
        elif first_input is not None:
            verdict = (f"inf/NaN entered the checked calls from code the checker does not see (first received by "
                       f"{first_input['call']}, rank {first_input['rank']}, step {first_input['step']}): the "
                       "optimizer step, the data or an unchecked region; not a device fault of a checked call")
        else:
            verdict = ""
        return {"verdict": verdict, "origin": origin, "first_input": first_input, "by_rank": by_rank}

    def call_done(self, rank: int, name: str, fwd: str, bwd: str, pfwd: str, pbwd: str, message: str,
                  module: str = "") -> None:
        with self._lock:
            self.checked[rank] += 1
            per_module = self.modules[module]
            per_module["calls"] += 1
            if ERROR in (fwd, bwd, pfwd, pbwd):
                per_module["errors"] += 1
            elif WARNING in (fwd, bwd, pfwd, pbwd):
                per_module["warnings"] += 1
            for s in (fwd, bwd):
                if s.strip():
                    self.result_status[s] += 1
            for s in (pfwd, pbwd):
                if s.strip():
                    self.precision_status[s] += 1
            if ERROR in (fwd, bwd, pfwd, pbwd):
                self.failed[rank] += 1
                api = call_api(name)
                self.failing[api] += 1
                if len(self.failing_examples[api]) < 3:     # bounded, however many calls fail
                    self.failing_examples[api].append((rank, name, message))

    def collective_row(self, rank: int, name: str, group: str, group_seq: int, status: str, finding: str,
                       message: str, named: tuple[int, ...] = (), members: str = "") -> None:
        """One row of a rank's collective CSV (gpu_server/checking/checker.py writes it; `seed_from_reports` reads it).
        `members`: the Ranks cell (the group's member ranks), which with the group and its seq names the collective."""
        with self._lock:
            self.collectives.add(rank, name, group, group_seq, status, finding, message, named, members)

    def standard_row(self, algorithm: str, status: str) -> None:
        """One api_precision_compare details row: counted per standard and status."""
        name = STANDARD_NAMES.get(algorithm.strip(), "none (SKIP or mismatch)")
        with self._lock:
            self.by_standard[name][status] += 1

    def resumed(self, resumed: bool, starts: int, replay: int, done: int, truncated: dict) -> None:
        with self._lock:
            self.session = {"resumed": resumed, "server_starts": starts, "records_reported_before": done,
                            "spool_records_at_start": replay, "unjournaled_bytes_cut": sum(truncated.values())}

    def backward_replayed(self, on_kept_graphs: bool) -> None:
        """A backward replay ran on its forward's kept graphs, or replayed the forward first."""
        with self._lock:
            self.graphs["backward_replays_on_kept_graphs" if on_kept_graphs else "backward_replays_forward_again"] += 1

    def set_graphs_dropped(self, dropped: int) -> None:
        """Kept graphs dropped before their backward came, to stay within --graph-memory-mb."""
        with self._lock:
            self.graphs["kept_graphs_dropped_for_memory"] = dropped

    def set_memory(self, budget: int, peak: int, reused: int = 0) -> None:
        """`reused`: records joined in memory an earlier record was joined in (gpu_server/intake/payload_pool.py)."""
        with self._lock:
            self.memory = {"payload_budget_bytes": budget, "payload_peak_bytes": peak, "payloads_reused": reused}

    def seed_from_reports(self, out_dir: str, ts: str, strict: bool = False) -> None:
        """A resumed session, or `gpu-server summary`: count the rows the earlier server processes wrote (after the
        cut-back), and find the first failing row and the modules from their Seq, Module and Source columns.
        Each file is opened as gpu_server/safe_open.py does (a regular file, never a link, never blocking): one that
        cannot be read is left out, or with `strict` (`gpu-server summary`) refused (FileRefused, a ValueError,
        naming it and what is wrong)."""
        def read(path: str) -> list[dict[str, str]] | None:
            return _read_rows(path, strict)

        for name, (kind, rank) in sorted(report_files.session_reports(out_dir, ts).items()):
            if kind != report_files.RESULT:
                continue
            rows = read(os.path.join(out_dir, name))
            if rows is None:
                continue
            precision = {(r.get("API Name"), r.get("Step")): r
                         for r in read(report_files.path(out_dir, report_files.PRECISION_RESULT, ts, rank)) or ()}
            for row in read(report_files.path(out_dir, report_files.PRECISION_DETAILS, ts, rank)) or ():
                self.standard_row(row.get("比对算法") or " ", row.get("比对结果") or SKIP)
                self._seed_row(rank, row, row.get("比对结果") or SKIP, "api_precision_compare")
            for row in read(report_files.path(out_dir, report_files.DETAILS, ts, rank)) or ():
                self._seed_row(rank, row, row.get("Status") or SKIP, "accuracy_checking")
            for r in rows:
                api = r.get("API name")
                if not api:
                    continue
                p = precision.get((api, r.get("Step")), {})
                self.call_done(rank, api, r.get("Forward Test Success") or " ", r.get("Backward Test Success") or " ",
                               p.get("Forward Test Success") or " ", p.get("Backward Test Success") or " ",
                               (p.get("Message") or "").strip() or r.get("Message") or "",
                               module=(r.get("Module") or "").strip())
            collective = report_files.path(out_dir, report_files.COLLECTIVE, ts, rank)
            for row in read(collective) or ():
                self.collective_row(rank, (row.get("API Name") or "").strip(), (row.get("Group") or "").strip(),
                                    _int(row.get("Group Seq")) or 0, (row.get("Status") or "").strip() or SKIP,
                                    (row.get("Finding") or "").strip(), (row.get("Message") or "").strip(),
                                    members=(row.get("Ranks") or "").strip())
            with self._lock:
                paths = report_files.rank_paths(out_dir, ts, rank)
                self.files.setdefault(rank, paths + [collective] if os.path.isfile(collective) else paths)

    def _seed_row(self, rank: int, row: dict, status: str, report: str) -> None:
        seq, step = _int(row.get("Seq")), _int(row.get("Step"))
        if seq is not None and step is not None:
            self.row_done(rank, step, seq, row.get("API Name") or "", status, report,
                          (row.get("Message") or "").strip(), (row.get("Module") or "").strip(),
                          (row.get("Source") or "").strip())

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
            return {   # the top-down view first (README, "Reading the report top-down"), then the counts
                "first_anomaly": self._first_anomaly(),
                "nonfinite": self._nonfinite(),
                "api_bias": self.pooled.as_dict() if self.pooled is not None else None,
                "modules": [{"module": m, "calls": c["calls"], "errors": c["errors"], "warnings": c["warnings"]}
                            for m, c in sorted(self.modules.items(),
                                               key=lambda kv: (-kv[1]["errors"], -kv[1]["warnings"], kv[0]))],
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
                "memory": {**self.memory, **self.graphs},
                "transport": dict(self.transport),
                "report_files": {str(k): v for k, v in self.files.items()},
                "report_write_failures": {"records": sum(self.report_failures.values()),
                                          "by_rank": {str(k): v for k, v in sorted(self.report_failures.items())},
                                          "examples": list(self.report_failure_examples)},
                "quarantined_records": list(self.quarantined),
                "durability": dict(self.durability),
                "collectives": self.collectives.as_dict(),
                "cpu_s": self.cpu,
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
        lines += _top_down(d)
        lines.append("  accuracy_checking (two-way):    " + _counts(d["accuracy_checking_status"]))
        lines.append("  api_precision_compare (standards): " + _counts(d["api_precision_compare_status"]))
        for name, counts in d["api_precision_compare_rows_by_standard"].items():
            lines.append(f"    {name:24s} rows: " + _counts(counts))
        for k, what in _TRANSPORT_LINES:
            if d["transport"].get(k):
                lines.append(f"  {k.replace('_', ' ')} records{what}: {d['transport'][k]}")
        if d["session"].get("resumed"):
            lines.append(f"  resumed session (server start {d['session']['server_starts']}): "
                         f"{d['session']['records_reported_before']} records reported by earlier starts")
        if d["transport"].get("replay_workers_replaced"):
            lines.append(f"  replay worker processes replaced (a replay crashed, ran out of --replay-memory-mb or "
                         f"past --replay-timeout-s): {d['transport']['replay_workers_replaced']}")
        if d["quarantined_records"]:
            lines.append(f"  quarantined records (SKIP rows): {len(d['quarantined_records'])}, e.g. "
                         f"{d['quarantined_records'][0]['call']}: {d['quarantined_records'][0]['why'][:160]}")
        for key, value in d["durability"].items():
            if value:
                lines.append(f"  {key.replace('_', ' ')}: {value}")
        again, dropped = d["memory"]["backward_replays_forward_again"], d["memory"]["kept_graphs_dropped_for_memory"]
        if dropped:
            lines.append(f"  backward replays that ran their forward again: {again} of "
                         f"{again + d['memory']['backward_replays_on_kept_graphs']} ({dropped} kept graphs dropped "
                         "to stay within gpu-server --graph-memory-mb; a larger one keeps them)")
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
        lines += _collective_lines(d.get("collectives") or {})
        if d["failing_apis"]:
            lines.append("  failing APIs (worst first):")
            for api, info in list(d["failing_apis"].items())[:10]:
                ex = info["examples"][0]
                lines.append(f"    {api}: {info['calls']} calls, e.g. {ex['call']} (rank {ex['rank']}): "
                             f"{ex['message'][:160]}")
        return "\n".join(lines)


FINDING_KINDS = ("matched", "mismatch", "missing", "unfinished", "evicted")   # gpu_server/checking/collectives.py's
MAX_COLLECTIVE_CELLS = 100_000   # (collective, group, rank) cells kept in the summary, however long the training
MAX_COLLECTIVE_FINDINGS = 200    # findings that name ranks, kept in order of arrival


class CollectiveCounts:
    """The collectives checked across ranks, from the rows of the collective CSVs (the caller holds the lock):
    rows by finding and status, collectives (group, member ranks, group seq) by finding, a ranks x collectives grid
    (per bare API and group, per rank: rows by status), the first message of each kind that is not `matched` (and
    the first error), and the findings that name ranks."""

    def __init__(self) -> None:
        self.rows_by_finding: collections.Counter = collections.Counter()
        self.rows_by_status: collections.Counter = collections.Counter()
        self._collectives: dict[str, set] = collections.defaultdict(set)   # finding -> {(api, group, group seq)}
        self.grid: dict[tuple[str, str], dict[int, collections.Counter]] = {}
        self.first: dict[str, dict] = {}
        self.findings: list[dict] = []
        self._finding_keys: set = set()

    def add(self, rank: int, name: str, group: str, group_seq: int, status: str, finding: str, message: str,
            named: tuple[int, ...] = (), members: str = "") -> None:
        api = call_api(name)
        self.rows_by_finding[finding] += 1
        self.rows_by_status[status] += 1
        key = (group, members, group_seq)   # one collective, whichever API each rank called
        if len(self._collectives[finding]) < MAX_COLLECTIVE_CELLS:
            self._collectives[finding].add(key)
        cells = self.grid.get((api, group))
        if cells is None and len(self.grid) < MAX_COLLECTIVE_CELLS:
            cells = self.grid[(api, group)] = {}
        if cells is not None:
            cells.setdefault(rank, collections.Counter())[status] += 1
        entry = {"call": name, "group": group, "group_seq": group_seq, "rank": rank, "finding": finding,
                 "status": status, "message": message[:500], "named": list(named)}
        if finding != "matched" and finding not in self.first:
            self.first[finding] = entry
        if status == ERROR and "error" not in self.first:
            self.first["error"] = entry
        if (finding != "matched" or named) and key + (finding,) not in self._finding_keys \
                and len(self.findings) < MAX_COLLECTIVE_FINDINGS:
            self._finding_keys.add(key + (finding,))
            self.findings.append({k: v for k, v in entry.items() if k not in ("rank", "status")})

    def as_dict(self) -> dict:
        ranks = sorted({r for cells in self.grid.values() for r in cells})
        return {
            "records": sum(self.rows_by_finding.values()),
            "records_by_finding": {k: self.rows_by_finding.get(k, 0) for k in FINDING_KINDS},
            "records_by_status": {s: self.rows_by_status.get(s, 0) for s in STATUSES},
            "collectives_by_finding": {k: len(self._collectives.get(k, ())) for k in FINDING_KINDS},
            "ranks": ranks,
            "grid": [{"api": api, "group": group,
                      "by_rank": {str(r): {s: c.get(s, 0) for s in STATUSES if c.get(s)}
                                  for r, c in sorted(cells.items())}}
                     for (api, group), cells in sorted(self.grid.items())],
            "first": dict(self.first),
            "findings": list(self.findings),
        }


def _collective_lines(c: dict) -> list[str]:
    """summary.human(): one line per finding kind seen, and the first mismatch (or missing rank, or error)."""
    if not c.get("records"):
        return []
    lines = [f"  collectives checked across ranks: {c['records']} records, "
             + ", ".join(f"{s} {n}" for s, n in c.get("records_by_status", {}).items())]
    for kind, n in c.get("records_by_finding", {}).items():
        if n:
            lines.append(f"    {kind:10s} {c.get('collectives_by_finding', {}).get(kind, 0)} collectives, {n} "
                         "records")
    first = c.get("first", {})
    for kind in ("mismatch", "missing", "error"):
        e = first.get(kind)
        if e:
            lines.append(f"    first {kind}: {e['call']} (group {e['group']}, seq {e['group_seq']}, rank "
                         f"{e['rank']}): {e['message'][:200]}")
            break
    return lines


def _where(e: dict) -> str:
    module = f" in {e['module']}" if e.get("module") else ""
    source = f" at {e['source']}" if e.get("source") else ""
    return f"{e['call']} {e.get('direction', '')} (rank {e['rank']}, step {e['step']}){module}{source}"


def _ratio(value) -> str:
    """A spread ratio of the pooled findings: None is how the JSON spells an infinite one."""
    return "inf" if value is None else f"{value:.3g}"


# transport counts in the human summary, with what they mean: "rejected" only for records that break the wire
# contract; a valid record that cannot be replayed here is "not replayable" (its SKIP row says why)
_TRANSPORT_LINES = (
    ("duplicates", ""),
    ("rejected", " (they break the wire contract: malformed, hostile, refused sizes or names)"),
    ("not_replayable", " (valid, but not replayable on this server: reported SKIP with the reason)"),
    ("filtered", ""),
    ("spool_replayed", ""),
)


def _top_down(d: dict) -> list[str]:
    """The lines a user reads first: the first failing call, where it runs, the origin of inf/NaN, the findings
    across calls and the modules with errors (README, "Reading the report")."""
    lines = []
    first = d["first_anomaly"]
    if first["earliest"]:
        e = first["earliest"]
        lines.append(f"  FIRST FAILING CALL: {_where(e)}")
        lines.append(f"    row {e['row']} ({e['report']}): {e['message'][:200]}")
        if e.get("evidence"):
            lines.append(f"    evidence (its tensors and replay.py): {e['evidence']}")
        others = [x for r, x in first["by_rank"].items() if x["row"] != e["row"] or x["rank"] != e["rank"]]
        for x in others[:8]:
            lines.append(f"    first on rank {x['rank']}: {_where(x)}")
    if d["nonfinite"]["verdict"]:
        lines.append(f"  inf/NaN: {d['nonfinite']['verdict']}")
        origin = d["nonfinite"]["origin"] or d["nonfinite"]["first_input"]
        if origin and (origin.get("module") or origin.get("source")):
            lines.append(f"    at {_where(origin)}")
    bias = d.get("api_bias") or {}
    for f in bias.get("findings", [])[:10]:
        lines.append(f"  across calls, {f['verdict'].upper()}: {f['api']} {f['direction']} {f['dtype']}: bias "
                     f"{f.get('bias_ulp', 0):+.4g} ULP, in magnitude {f.get('magnitude_bias_ulp', 0):+.4g} ULP, "
                     f"spread ratio {_ratio(f.get('spread_ratio'))} over {f.get('calls', 0)} calls (smallest "
                     f"detectable {f.get('detectable_ulp', 0):.2g} ULP)")
    failing = [m for m in d["modules"] if m["errors"]]
    if failing:
        lines.append("  modules with failing calls: " + ", ".join(
            f"{m['module'] or '(outside any module)'} {m['errors']}/{m['calls']}" for m in failing[:6]))
    return lines


def _counts(c: dict) -> str:
    return ", ".join(f"{s} {c.get(s, 0)}" for s in STATUSES)


class SavedFindings:
    """The pooled findings of a finished session, as its summary JSON saved them (`gpu-server summary`)."""

    def __init__(self, saved: dict):
        self.saved = saved

    def as_dict(self) -> dict:
        return self.saved


def _read_rows(path: str, strict: bool = False) -> list[dict[str, str]] | None:
    """A report CSV's rows as dicts by column title; None when there is no such file. One that is not a regular
    file, is a link, or is malformed (gpu_server/safe_open.py) is None too, or with `strict` a FileRefused."""
    from gpu_server.columns import (
        COLLECTIVE_HEADER,
        DETAILS_HEADER,
        PRECISION_DETAILS_HEADER,
        PRECISION_RESULT_HEADER,
        RESULT_HEADER,
    )

    parsed = report_files.parse(os.path.basename(path))
    kind = parsed[0] if parsed else ""
    header = {report_files.RESULT: RESULT_HEADER, report_files.DETAILS: DETAILS_HEADER,
              report_files.PRECISION_RESULT: PRECISION_RESULT_HEADER,
              report_files.PRECISION_DETAILS: PRECISION_DETAILS_HEADER,
              report_files.COLLECTIVE: COLLECTIVE_HEADER}.get(kind, [])
    try:
        return csv_rows(path, f"{kind or 'CSV'} report", [c for c in header if c != "Message"],
                        hint="restore it from the server's output, or move it out of the folder")[1]
    except FileRefused as exc:
        if exc.missing:
            return None
        if strict:
            raise
        log.warning("summary: %s; its rows are not counted", exc)
        return None


def _int(cell: str | None) -> int | None:
    try:
        return int(str(cell).strip())
    except (TypeError, ValueError):
        return None

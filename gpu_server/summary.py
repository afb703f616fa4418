"""Counts for the live progress line, the end-of-run summary and summary.json (SPEC §5.1, §7)."""
from __future__ import annotations

import collections
import json
import os
import threading
import time

STATUSES = ("pass", "Warning", "error", "SKIP")


class Summary:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.received: collections.Counter = collections.Counter()     # per rank
        self.checked: collections.Counter = collections.Counter()      # calls with a result row, per rank
        self.failed: collections.Counter = collections.Counter()       # calls with an error, per rank
        self.result_status: collections.Counter = collections.Counter()
        self.precision_status: collections.Counter = collections.Counter()
        self.failing: dict[str, list] = collections.defaultdict(list)  # bare API -> [(rank, call, message)]
        self.ends: dict[tuple[str, int], dict] = {}
        self.files: dict[int, list[str]] = {}
        self.transport: dict[str, int] = collections.Counter()

    def add_files(self, rank: int, paths: list[str]) -> None:
        with self._lock:
            self.files[rank] = paths

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
            if "error" in (fwd, bwd, pfwd, pbwd):
                self.failed[rank] += 1
                api = ".".join(name.split(".")[:2])
                self.failing[api].append((rank, name, message))

    def rank_ended(self, run_id: str, rank: int, counts: dict) -> None:
        with self._lock:
            self.ends[(run_id, rank)] = counts

    def progress_line(self) -> str:
        with self._lock:
            ranks = sorted(set(self.received) | set(self.checked))
            per = " ".join(f"r{r}:{self.received[r]}/{self.checked[r]}/{self.failed[r]}" for r in ranks)
            line = (f"received {sum(self.received.values())}, checked {sum(self.checked.values())}, "
                    f"failed {sum(self.failed.values())} calls")
            return line + (f"  [rank:recv/checked/failed {per}]" if per else "")

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "elapsed_s": round(time.time() - self.started, 3),
                "records_received": dict(self.received), "calls_checked": dict(self.checked),
                "calls_failed": dict(self.failed),
                "accuracy_checking_status": dict(self.result_status),
                "api_precision_compare_status": dict(self.precision_status),
                "failing_apis": {api: {"calls": len(v), "examples": [{"rank": r, "call": n, "message": m}
                                                                      for r, n, m in v[:3]]}
                                 for api, v in sorted(self.failing.items(), key=lambda kv: -len(kv[1]))},
                "ranks_ended": [{"run_id": rid, "rank": rk, **c} for (rid, rk), c in self.ends.items()],
                "transport": dict(self.transport),
                "report_files": {str(k): v for k, v in self.files.items()},
            }

    def write_json(self, out_dir: str, ts: str) -> str:
        path = os.path.join(out_dir, f"summary_{ts}.json")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.as_dict(), fh, indent=2, ensure_ascii=False)
        os.replace(tmp, path)
        return path

    def human(self) -> str:
        d = self.as_dict()
        lines = [f"gpu-server summary: {sum(d['records_received'].values())} records received, "
                 f"{sum(d['calls_checked'].values())} API calls checked, {sum(d['calls_failed'].values())} failed "
                 f"({d['elapsed_s']:.1f} s)"]
        lines.append("  accuracy_checking (two-way):    " + _counts(d["accuracy_checking_status"]))
        lines.append("  api_precision_compare (standards): " + _counts(d["api_precision_compare_status"]))
        for k in ("duplicates", "rejected", "filtered"):
            if d["transport"].get(k):
                lines.append(f"  {k} records: {d['transport'][k]}")
        for end in d["ranks_ended"]:
            lines.append(f"  rank {end['rank']} (run {end['run_id']}): captured {end.get('captured', 0)}, sent "
                         f"{end.get('sent', 0)}, dropped {end.get('dropped', 0)} by the agent")
        if d["failing_apis"]:
            lines.append("  failing APIs (worst first):")
            for api, info in list(d["failing_apis"].items())[:10]:
                ex = info["examples"][0]
                lines.append(f"    {api}: {info['calls']} calls, e.g. {ex['call']} (rank {ex['rank']}): "
                             f"{ex['message'][:160]}")
        return "\n".join(lines)


def _counts(c: dict) -> str:
    return ", ".join(f"{s} {c.get(s, 0)}" for s in STATUSES)

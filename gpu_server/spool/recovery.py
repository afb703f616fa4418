"""Restart with the same --out: bring the report files back to what the journal says is complete.

With a sound journal, every report file of the session is cut back to its journaled size: the rows of records that
were not yet journaled (and any half-written row) disappear and are written again when those records are checked
again from the spool.

With a damaged journal (gpu_server/spool/journal.py) nothing is cut but a trailing half-written row: the report
files are the better record. What is done is rebuilt from them: a spooled record whose call has its result row is
done, a forward record whose detail rows are written (and no result row yet) waits for its backward record.
"""
from __future__ import annotations

import csv
import logging
import os

from gpu_server.reports import files as report_files
from gpu_server.spool.journal import JournalState
from gpu_server.spool.segments import Entry
from protos import online_check_pb2 as pb

log = logging.getLogger("gpu_server")


def _truncate(path: str, size: int, fsync: bool) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(size)
        if fsync:
            os.fsync(fh.fileno())


def _complete_rows_size(path: str) -> int:
    """Bytes up to and including the last newline (a row is never split over lines: messages are one line)."""
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - (64 << 10))
            fh.seek(start)
            i = fh.read(end - start).rfind(b"\n")
            if i >= 0:
                return start + i + 1
            end = start
    return 0


def cut_reports(out_dir: str, ts: str, state: JournalState, fsync: bool) -> dict[str, int]:
    """Cut the session's report files back; returns file name -> bytes cut off."""
    cut: dict[str, int] = {}
    for name in report_files.session_reports(out_dir, ts):
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path) or os.path.islink(path):
            log.warning("spool: %s is not a regular file; it is left alone", path)
            continue
        size = os.path.getsize(path)
        keep = _complete_rows_size(path) if state.damaged else state.files.get(name, 0)
        if size > keep:
            _truncate(path, keep, fsync)
            cut[name] = size - keep
        elif size < keep:
            log.warning("spool: %s is shorter (%d bytes) than journaled (%d): rows were lost with the page "
                        "cache (power failure?)", name, size, keep)
        state.files[name] = min(size, keep)
    return cut


def _calls(path: str) -> list[tuple[str, str]]:
    """(API name, Step) of every row of a report file (the Step column found by its header: our columns after
    msprobe's may grow)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            rows = list(csv.reader(fh))
    except (OSError, csv.Error, UnicodeDecodeError):
        return []
    if not rows:
        return []
    step = rows[0].index("Step") if "Step" in rows[0] else -1
    return [(r[0], r[step]) for r in rows[1:] if len(r) > max(step, 0)]


def rebuild_from_reports(out_dir: str, ts: str, entries: list[Entry], state: JournalState) -> int:
    """A damaged journal: mark the spooled records whose rows the report files hold as done (or half); returns how
    many records were found reported."""
    results: dict[int, set[tuple[str, str]]] = {}
    forwards: dict[int, set[tuple[str, str]]] = {}
    for rank in {e.key[1] for e in entries}:
        results[rank] = set(_calls(report_files.path(out_dir, report_files.RESULT, ts, rank)))
        forwards[rank] = {(parts[0], step) for name, step in
                          _calls(report_files.path(out_dir, report_files.DETAILS, ts, rank))
                          if (parts := report_files.split_row_name(name)) and parts[1] == "forward"}
    found = 0
    for e in entries:
        call = (e.name, str(e.step))
        if call in results.get(e.key[1], ()):
            state.mark_done(e.key)
            found += 1
        elif e.direction != pb.BACKWARD and call in forwards.get(e.key[1], ()):
            state.half.add(e.key)
            found += 1
    return found

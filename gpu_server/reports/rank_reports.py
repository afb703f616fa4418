"""The CSV reports of one rank (docs/design.md §6.6): msprobe's file names (gpu_server/reports/files.py) and headers,
UTF-8 with
BOM, one row at a time, flushed after each row. Our own columns (Step, Seq, Module, Source: columns.EXTRA_COLUMNS) come
after msprobe's; a row's Seq, Module and Source come in a `Where`. api_precision_compare_details ends with the
precision standards' own columns (columns.PRECISION_EXTRA_COLUMNS: mixed tolerance, quantisation), after Source.

Open files are bounded: the report files of every rank share one `OpenFiles` cache (least recently used closed
first, reopened in append mode), sized from the process's open-file limit, so hundreds of ranks do not exhaust
file descriptors. A row is written whole or not at all: a failed write is cut back to the row's start. A full
disk pauses the writer until space is freed (gpu_server/disk.py); any other failure raises `ReportWriteError`
(the record stays in the spool, the summary and the exit status say so).
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import errno
import io
import logging
import math
import os
import resource
import threading
import time
from typing import Callable

from gpu_server import disk
from gpu_server.columns import (
    BLANK,
    COLLECTIVE_HEADER,
    DETAILS_HEADER,
    EXTRA_COLUMNS,
    FLOAT_DECIMALS,
    METRIC_COLUMNS,
    PRECISION_DETAILS_HEADER,
    PRECISION_EXTRA_COLUMNS,
    PRECISION_RESULT_HEADER,
    RESULT_HEADER,
)
from gpu_server.judging.metrics import OutputMetrics
from gpu_server.reports import files as report_files

log = logging.getLogger("gpu_server")
_BOM = "\ufeff".encode()


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a row's call was made: the record's seq (None: unknown), its module path and source location (the
    agent's npu_agent.location, as the intake kept them)."""

    seq: int | None = None
    module: str = ""
    source: str = ""


NOWHERE = Where()


def _tail(step: int, where: Where) -> list:
    """The cells of our own columns (EXTRA_COLUMNS): Step, Seq, Module, Source."""
    return [step, BLANK if where.seq is None else where.seq, clean(where.module) or BLANK,
            clean(where.source) or BLANK]


class ReportWriteError(OSError):
    """A report row could not be written (not for lack of space: that waits)."""


def _default_open_limit() -> int:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(8, min(512, soft // 8))


class OpenFiles:
    """A bounded set of open report files shared by all ranks: the least recently used is closed first."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or _default_open_limit()
        self.lock = threading.Lock()
        self._open: collections.OrderedDict[str, io.FileIO] = collections.OrderedDict()
        self.reopened = 0

    def handle(self, path: str) -> io.FileIO:
        """The open append handle of `path` (call with `lock` held)."""
        fh = self._open.get(path)
        if fh is not None:
            self._open.move_to_end(path)
            return fh
        while len(self._open) >= self.limit:
            self._open.popitem(last=False)[1].close()
        try:
            fh = open(path, "ab", buffering=0)   # unbuffered: nothing left behind by a failed write
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._open:
                raise
            while self._open:   # the process is out of descriptors: give back ours and try once more
                self._open.popitem(last=False)[1].close()
            self.limit = max(4, self.limit // 2)
            fh = open(path, "ab", buffering=0)
        self._open[path] = fh
        self.reopened += 1
        return fh

    def close(self, path: str) -> None:
        with self.lock:
            fh = self._open.pop(path, None)
            if fh is not None:
                fh.close()


OPEN_FILES = OpenFiles()


def cell(value) -> str:
    """A report cell: floats with 14 decimals, nan/inf spelled out, None as a single space."""
    if value is None:
        return BLANK
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.{FLOAT_DECIMALS}f}"
    return str(value)


def clean(text: str) -> str:
    """Message text for a cell: one line, bounded, and never starting like a spreadsheet formula."""
    text = " ".join(str(text).split())[:2000]
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


class _CsvFile:
    def __init__(self, path: str, header: list[str], files: OpenFiles | None = None):
        self.path = path
        self.files = files or OPEN_FILES
        self._buf = io.StringIO()
        self._writer = csv.writer(self._buf)
        fresh = not os.path.exists(path) or os.path.getsize(path) == 0
        if fresh:
            self.write(header, bom=True)

    def write(self, row: list, bom: bool = False) -> None:
        self._buf.seek(0)
        self._buf.truncate()
        self._writer.writerow(row)
        data = (_BOM if bom else b"") + self._buf.getvalue().encode("utf-8")
        since = time.monotonic()
        while True:
            with self.files.lock:
                try:
                    fh = self.files.handle(self.path)
                except OSError as exc:
                    raise ReportWriteError(exc.errno, f"cannot open {self.path}: {exc.strerror or exc}") from exc
                start = fh.seek(0, os.SEEK_END)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[fh.write(view):]
                    return
                except OSError as exc:
                    _undo(fh, start)
                    if not disk.is_full(exc):
                        raise ReportWriteError(exc.errno, f"cannot write {self.path}: {exc.strerror or exc}") \
                            from exc
            if not disk.wait_for_space(self.path, since):
                raise ReportWriteError(errno.ENOSPC, f"cannot write {self.path}: the disk stayed full")

    def close(self) -> None:
        self.files.close(self.path)


def _undo(fh, start: int) -> None:
    """Cut a failed row back to its start: never a half-written row."""
    try:
        os.ftruncate(fh.fileno(), start)
    except (OSError, ValueError):
        pass


class RankReports:
    """The report files of one rank. Only one worker writes a given rank; the lock guards the rare others."""

    def __init__(self, out_dir: str, ts: str, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        extra = list(EXTRA_COLUMNS)
        self._collective_path = report_files.path(out_dir, report_files.COLLECTIVE, ts, rank)
        # the collective CSV exists only for ranks that sent collectives: opened with the first row (or at once
        # when an earlier start of this session wrote it)
        self.collective: _CsvFile | None = None
        if os.path.exists(self._collective_path):
            self.collective = _CsvFile(self._collective_path, COLLECTIVE_HEADER + extra)

        def csv_file(kind: str, header: list[str]) -> _CsvFile:
            return _CsvFile(report_files.path(out_dir, kind, ts, rank), header + extra)

        self.result = csv_file(report_files.RESULT, RESULT_HEADER)
        self.details = csv_file(report_files.DETAILS, DETAILS_HEADER)
        self.precision_result = csv_file(report_files.PRECISION_RESULT, PRECISION_RESULT_HEADER)
        # the precision standards' own columns after Step, Seq, Module, Source: msprobe's and ours stay in place
        self.precision_details = _CsvFile(report_files.path(out_dir, report_files.PRECISION_DETAILS, ts, rank),
                                          PRECISION_DETAILS_HEADER + extra + PRECISION_EXTRA_COLUMNS)

    @property
    def paths(self) -> list[str]:
        """The rank's report files: msprobe's four, then its collective CSV once it has one."""
        return [f.path for f in self._files()]

    @property
    def collective_path(self) -> str:
        """Where the rank's collective CSV is (or will be, with its first row)."""
        return self._collective_path

    def _files(self) -> list[_CsvFile]:
        files = [self.result, self.details, self.precision_result, self.precision_details]
        return files + [self.collective] if self.collective is not None else files

    def write(self, rows: list[Row]) -> bool:
        """Write rows in order, each whole or not at all (raises ReportWriteError); True when one of them created
        the collective CSV."""
        created = False
        for row in rows:
            with self._lock:
                target = self._target(row.kind)
                if target is None:
                    created = True
                    target = self.collective = _CsvFile(self._collective_path, COLLECTIVE_HEADER + list(EXTRA_COLUMNS))
                target.write(list(row.cells))
        return created

    def _target(self, kind: str) -> _CsvFile | None:
        return {report_files.RESULT: self.result, report_files.DETAILS: self.details,
                report_files.PRECISION_RESULT: self.precision_result,
                report_files.PRECISION_DETAILS: self.precision_details,
                report_files.COLLECTIVE: self.collective}[kind]

    def close(self) -> None:
        for f in self._files():
            f.close()


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a rank's reports as a value: which file (a report_files kind) and its cells. The checker
    computes rows (gpu_server/checking/checker.py); `RankReports.write` writes them."""

    kind: str
    cells: tuple


def collective_row(api: str, group: str, ranks: str, group_seq: int, op: str, dtype: str, shape: str, status: str,
                   finding: str, message: str, step: int, where: Where = NOWHERE) -> Row:
    return Row(report_files.COLLECTIVE, (api, group or BLANK, ranks or BLANK, group_seq, op or BLANK, dtype or BLANK,
                                         shape or BLANK, status or BLANK, finding or BLANK, clean(message) or BLANK,
                                         *_tail(step, where)))


def result_row(api: str, forward: str, backward: str, message: str, step: int, where: Where = NOWHERE) -> Row:
    return Row(report_files.RESULT, (api, forward, backward, clean(message) or BLANK, *_tail(step, where)))


def detail_row(row_name: str, bench_dtype: str, device_dtype: str, shape: str, metrics: OutputMetrics | None,
               status: str, message: str, step: int, where: Where = NOWHERE) -> Row:
    values = [cell(getattr(metrics, attr) if metrics else None) for attr, _ in METRIC_COLUMNS]
    return Row(report_files.DETAILS, (row_name, bench_dtype or BLANK, device_dtype or BLANK, shape or BLANK, *values,
                                      status, clean(message) or BLANK, *_tail(step, where)))


def precision_result_row(api: str, forward: str, backward: str, message: str, step: int,
                         where: Where = NOWHERE) -> Row:
    return Row(report_files.PRECISION_RESULT, (api, forward, backward, clean(message) or BLANK, *_tail(step, where)))


def precision_detail_row(row_name: str, cells: dict, status: str, algorithm: str, message: str, step: int,
                         where: Where = NOWHERE) -> Row:
    row = [row_name]
    for title in PRECISION_DETAILS_HEADER[1:-3]:
        row.append(cell(cells.get(title)))
    row += [status, algorithm or BLANK, clean(message) or BLANK, *_tail(step, where)]
    row += [cell(cells.get(title)) for title in PRECISION_EXTRA_COLUMNS]
    return Row(report_files.PRECISION_DETAILS, tuple(row))


class Reports:
    """The report files of the ranks one worker writes (gpu_server/checking/workers.py), opened with the rank's first
    row;
    `on_files(rank, paths)` learns each rank's files (when opened, and when the collective CSV is made)."""

    def __init__(self, out_dir: str, ts: str, on_files: Callable[[int, list[str]], None]):
        self.out_dir, self.ts = out_dir, ts
        self.on_files = on_files
        self._ranks: dict[int, RankReports] = {}

    def of(self, rank: int) -> RankReports:
        rep = self._ranks.get(rank)
        if rep is None:
            rep = self._ranks[rank] = RankReports(self.out_dir, self.ts, rank)
            self.on_files(rank, rep.paths)
        return rep

    def write(self, rank: int, rows: list[Row]) -> None:
        """Raises ReportWriteError (the rows before the failing one are written)."""
        rep = self.of(rank)
        if rep.write(rows):
            self.on_files(rank, rep.paths)

    def close(self) -> None:
        for rep in self._ranks.values():
            rep.close()


def header_size(path: str) -> int:
    """Bytes of a report file's header line (BOM included); 0 when it has none or cannot be read."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64 << 10)
    except OSError:
        return 0
    i = head.find(b"\n")
    return i + 1 if i >= 0 else 0


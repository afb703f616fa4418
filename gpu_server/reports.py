"""The CSV reports of one rank (SPEC §7): msprobe's file names and headers, UTF-8 with BOM, one row at a time,
flushed after each row. Our own columns (Step) come after msprobe's.
"""
from __future__ import annotations

import csv
import math
import os
import threading

from gpu_server.columns import (
    BLANK,
    DETAILS_HEADER,
    EXTRA_COLUMNS,
    FLOAT_DECIMALS,
    METRIC_COLUMNS,
    PRECISION_DETAILS_HEADER,
    PRECISION_RESULT_HEADER,
    RESULT_HEADER,
)
from gpu_server.metrics import OutputMetrics


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
    def __init__(self, path: str, header: list[str]):
        self.path = path
        fresh = not os.path.exists(path) or os.path.getsize(path) == 0
        self._fh = open(path, "a", encoding="utf-8-sig", newline="")
        self._writer = csv.writer(self._fh)
        if fresh:
            self.write(header)

    def write(self, row: list) -> None:
        self._writer.writerow(row)
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class RankReports:
    """The report files of one rank. Only one worker writes a given rank; the lock guards the rare others."""

    def __init__(self, out_dir: str, ts: str, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        extra = list(EXTRA_COLUMNS)
        base = os.path.join(out_dir, "{}_" + f"{ts}_rank{rank}.csv")
        self.result = _CsvFile(base.format("accuracy_checking_result"), RESULT_HEADER + extra)
        self.details = _CsvFile(base.format("accuracy_checking_details"), DETAILS_HEADER + extra)
        self.precision_result = _CsvFile(base.format("api_precision_compare_result"), PRECISION_RESULT_HEADER + extra)
        self.precision_details = _CsvFile(base.format("api_precision_compare_details"),
                                          PRECISION_DETAILS_HEADER + extra)

    @property
    def paths(self) -> list[str]:
        return [f.path for f in (self.result, self.details, self.precision_result, self.precision_details)]

    def write_result(self, api: str, forward: str, backward: str, message: str, step: int) -> None:
        with self._lock:
            self.result.write([api, forward, backward, clean(message) or BLANK, step])

    def write_detail(self, row_name: str, bench_dtype: str, device_dtype: str, shape: str,
                     metrics: OutputMetrics | None, status: str, message: str, step: int) -> None:
        values = [cell(getattr(metrics, attr) if metrics else None) for attr, _ in METRIC_COLUMNS]
        with self._lock:
            self.details.write([row_name, bench_dtype or BLANK, device_dtype or BLANK, shape or BLANK, *values, status,
                                clean(message) or BLANK, step])

    def write_precision_result(self, api: str, forward: str, backward: str, message: str, step: int) -> None:
        with self._lock:
            self.precision_result.write([api, forward, backward, clean(message) or BLANK, step])

    def write_precision_detail(self, row_name: str, cells: dict, status: str, algorithm: str, message: str,
                               step: int) -> None:
        row = [row_name]
        for title in PRECISION_DETAILS_HEADER[1:-3]:
            row.append(cell(cells.get(title)))
        row += [status, algorithm or BLANK, clean(message) or BLANK, step]
        with self._lock:
            self.precision_details.write(row)

    def close(self) -> None:
        for f in (self.result, self.details, self.precision_result, self.precision_details):
            f.close()


class _NullReports:
    """Stands in for a rank's report files when rows must not be written (a restored job whose rows exist)."""

    paths: list[str] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


NULL_REPORTS = _NullReports()


def load(out_dir: str, kind: str = "details"):
    """The reports of `out_dir` as one pandas DataFrame (all ranks and steps): see gpu_server/report_frame.py."""
    from gpu_server.report_frame import load as _load

    return _load(out_dir, kind)

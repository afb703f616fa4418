"""The reports as data: `gpu_server.reports.load(OUT)` -> one pandas DataFrame over every rank and step.

A `--out` folder holds, per server session `{ts}` and rank `r`, the four CSV files of
gpu_server/reports/rank_reports.py. `load`
reads one kind of them (all ranks, all sessions) into one frame:

- msprobe's headers are kept as they are (Chinese ones included), every cell typed: metric and ratio columns are
  floats (a blank cell, `' '`, is NaN; `nan`/`inf` are read as such), `Step` and `Seq` are (nullable) integers,
  `Module` and `Source` strings ("" when blank or when a file predates them), statuses are strings;
- each msprobe column also gets an English alias (`cosine`, `rmse_ratio`, `result`, `algorithm`, ...; see ALIASES);
- lower-case aliases of our own columns: `step`, `seq`, `module`, `source`;
- columns of our own: `rank`, `ts` (the server session), `file`, and from the row's API name `call`
  (`Functional.gelu.0`), `api` (`Functional.gelu`), `direction` (forward/backward) and `output` (the index) for
  the details kinds.

Kinds: "result" (accuracy_checking_result), "details" (accuracy_checking_details), "precision_result"
(api_precision_compare_result), "precision_details" (api_precision_compare_details); msprobe's file prefixes are
accepted too.
"""
from __future__ import annotations

import glob
import os

import pandas as pd

from gpu_server.columns import (
    BLANK,
    DETAILS_HEADER,
    EXTRA_COLUMNS,
    METRIC_COLUMNS,
    PRECISION_DETAILS_HEADER,
    PRECISION_EXTRA_COLUMNS,
    PRECISION_RESULT_HEADER,
    RESULT_HEADER,
)
from gpu_server.reports import files as report_names
from gpu_server.safe_open import FileRefused, check_csv, open_regular
from protos.limits import call_api

KINDS = {
    "result": report_names.RESULT,
    "details": report_names.DETAILS,
    "precision_result": report_names.PRECISION_RESULT,
    "precision_details": report_names.PRECISION_DETAILS,
}
HEADERS = {"result": RESULT_HEADER, "details": DETAILS_HEADER, "precision_result": PRECISION_RESULT_HEADER,
           "precision_details": PRECISION_DETAILS_HEADER}

# English aliases of msprobe's columns (the metric ones by gpu_server.judging.metrics.OutputMetrics attribute).
_PRECISION_ALIASES = [
    "api_name", "small_value_error_ratio_ratio", "small_value_status", "rmse_ratio", "rmse_status",
    "max_rel_err_ratio", "max_rel_err_status", "mean_rel_err_ratio", "mean_rel_err_status", "error_balance_ratio",
    "error_balance_status", "inf_nan_error_rate", "inf_nan_status", "rel_err_rate", "rel_err_status",
    "abs_err_rate", "abs_err_status", "binary_error_rate", "binary_status", "ulp_mean", "ulp_over_threshold",
    "ulp_over_threshold_ratio", "ulp_status", "thousandth", "thousandth_status", "result", "algorithm", "message",
]
ALIASES: dict[str, dict[str, str]] = {
    "result": dict(zip(RESULT_HEADER, ["api_name", "forward", "backward", "message"])),
    "precision_result": dict(zip(PRECISION_RESULT_HEADER, ["api_name", "forward", "backward", "message"])),
    "details": dict(zip(DETAILS_HEADER, ["api_name", "bench_dtype", "device_dtype", "shape"]
                        + [attr for attr, _ in METRIC_COLUMNS] + ["status", "message"])),
    "precision_details": dict(zip(PRECISION_DETAILS_HEADER, _PRECISION_ALIASES)),
}
if len(_PRECISION_ALIASES) != len(PRECISION_DETAILS_HEADER):  # pragma: no cover - a columns.py change
    raise RuntimeError("report_frame: api_precision_compare_details aliases out of step with gpu_server.columns")
# numeric columns (typed as floats); every other column stays text, columns added later included
_NUMERIC = {title for _, title in METRIC_COLUMNS} | {
    c for c in PRECISION_DETAILS_HEADER[1:]
    if not c.endswith("判定结果") and c not in ("比对结果", "比对算法", "Message")} | {
    c for c in PRECISION_EXTRA_COLUMNS if not c.endswith("判定结果")}


def kind_of(kind: str) -> str:
    """'details' for 'details' or 'accuracy_checking_details', ...; a clear error for anything else."""
    if kind in KINDS:
        return kind
    for short, prefix in KINDS.items():
        if kind == prefix:
            return short
    raise ValueError(f"unknown report kind {kind!r}: use one of {', '.join(KINDS)} (or msprobe's file prefixes)")


def report_files(out_dir: str, kind: str) -> list[tuple[str, str, int]]:
    """(path, ts, rank) of every `kind` report in `out_dir`, by session then rank."""
    prefix = KINDS[kind_of(kind)]
    found = []
    for path in glob.glob(os.path.join(glob.escape(out_dir), report_names.rank_glob(prefix))):
        parsed = report_names.parse(os.path.basename(path))
        if parsed and parsed[0] == prefix:
            found.append((path, parsed[1], parsed[2]))
    return sorted(found, key=lambda f: (f[1], f[2]))


def _typed(frame: pd.DataFrame, kind: str) -> pd.DataFrame:
    for column in frame.columns:
        if column in ("Step", "Seq"):
            frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("Int64")
        elif column in ("Module", "Source"):   # text; blank (or absent from an older file) is ""
            frame[column] = frame[column].fillna("").replace(BLANK, "").astype(str)
        elif column in _NUMERIC:
            frame[column] = pd.to_numeric(frame[column].str.strip().replace("", None), errors="coerce").astype(float)
    for chinese, english in ALIASES[kind].items():
        if chinese in frame.columns and english not in frame.columns:
            frame[english] = frame[chinese]
    for ours in EXTRA_COLUMNS:
        if ours in frame.columns:
            frame[ours.lower()] = frame[ours]
    name = frame.columns[0]
    if kind in ("details", "precision_details"):
        parts = frame[name].str.extract(report_names.ROW_NAME)
        frame["call"] = parts["call"]
        frame["direction"] = parts["direction"]
        frame["output"] = pd.to_numeric(parts["index"], errors="coerce").astype("Int64")
    else:
        frame["call"] = frame[name]
    frame["api"] = frame["call"].map(call_api)
    return frame


def read_csv(path: str, kind: str) -> pd.DataFrame:
    """One report file, typed, with the English aliases (no rank/ts columns)."""
    kind = kind_of(kind)
    return _typed(_read_text(path, kind), kind)


def _read_text(path: str, kind: str) -> pd.DataFrame:
    """One report file as text columns, checked first (gpu_server/safe_open.py): a regular file (never a link, a
    FIFO or a device), UTF-8, msprobe's header (its Message column and our Step, Seq, Module and Source may be
    absent: they are then blank), every row as long as the header, not cut short. Anything else is a FileRefused (a
    ValueError) naming the file."""
    required = [c for c in HEADERS[kind] if c != "Message"]
    hint = "restore it from the server's output, or move it out of the folder"
    with open_regular(path, what=f"{KINDS[kind]} report") as fh:
        header = check_csv(fh, path, f"{KINDS[kind]} report", required, hint)
        try:
            frame = pd.read_csv(fh, encoding="utf-8-sig", dtype=str, keep_default_na=False)
        except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
            raise FileRefused(path, f"not a readable CSV report ({' '.join(str(exc).split())[:200]}); "
                                    f"{hint}") from None
    if len(frame.columns) != len(header):    # the two parsers disagree: never seen with a file that passed
        raise FileRefused(path, f"read as {len(frame.columns)} columns, its header has {len(header)}; {hint}")
    for column in ["Message", *EXTRA_COLUMNS]:
        if column not in frame.columns:
            frame[column] = ""
    return frame


def load(out_dir: str, kind: str = "details") -> pd.DataFrame:
    """Every `kind` report in `out_dir` (all ranks and sessions) as one frame: msprobe's columns, typed, plus English
    aliases and `rank`, `ts`, `file`, `call`, `api` (and `direction`, `output` for the details kinds)."""
    kind = kind_of(kind)
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"{out_dir}: no such folder (give the server's --out)")
    frames, ranks, tss, files = [], [], [], []
    for path, ts, rank in report_files(out_dir, kind):
        frame = _read_text(path, kind)
        frames.append(frame)
        ranks += [rank] * len(frame)
        tss += [ts] * len(frame)
        files += [os.path.basename(path)] * len(frame)
    if frames:   # typed once, all files together (one by one cost ~25 ms a file: 30 s for 300 ranks)
        frame = _typed(pd.concat(frames, ignore_index=True), kind)
        frame.insert(0, "rank", pd.Series(ranks, dtype=int))
        frame.insert(1, "ts", pd.Series(tss, dtype=str))
        frame["file"] = files
        return frame
    frame = _typed(pd.DataFrame({c: pd.Series(dtype=str) for c in HEADERS[kind] + list(EXTRA_COLUMNS)}), kind)
    frame.insert(0, "rank", pd.Series(dtype=int))
    frame.insert(1, "ts", pd.Series(dtype=str))
    frame["file"] = pd.Series(dtype=str)
    return frame

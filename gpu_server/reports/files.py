"""The one place that names the report files: msprobe's four CSV files per rank, the collective CSV of the ranks
that made collectives, and the summary.

    accuracy_checking_result_{ts}_rank{r}.csv      api_precision_compare_result_{ts}_rank{r}.csv
    accuracy_checking_details_{ts}_rank{r}.csv     api_precision_compare_details_{ts}_rank{r}.csv
    collective_result_{ts}_rank{r}.csv             (one row per torch.distributed collective record of the rank;
                                                   only for ranks that sent collectives)
    summary_{ts}.json                              api_bias_{ts}.csv (the pooled test across calls, all ranks)
    report_{ts}.html                               (gpu_server/reports/html.py)

`{ts}` is the session's start time (`%Y%m%d%H%M%S`, kept across restarts with the same --out); "*" in its place gives
the glob pattern of every session's file (`glob.glob(summary_path(out, "*"))`).

The detail rows' names (the `API Name` of accuracy_checking_details and api_precision_compare_details) are built and
split here too: `row_name` ("Functional.linear.0.forward.output.1"), `split_row_name` and `ROW_NAME` (the pattern,
for a whole column at once). Nothing else spells a file name or takes a row name apart
(tests/test_report_vocabulary.py).
"""
from __future__ import annotations

import os
import re

RESULT = "accuracy_checking_result"
DETAILS = "accuracy_checking_details"
PRECISION_RESULT = "api_precision_compare_result"
PRECISION_DETAILS = "api_precision_compare_details"
KINDS = (RESULT, DETAILS, PRECISION_RESULT, PRECISION_DETAILS)   # msprobe's four, written for every reported rank
COLLECTIVE = "collective_result"   # our own: one rank's collectives checked across ranks (columns.COLLECTIVE_HEADER)
RANK_KINDS = KINDS + (COLLECTIVE,)  # every per-rank report file: cut back, journaled and counted alike

_NAME = re.compile(r"^(" + "|".join(RANK_KINDS) + r")_(\d{14})_rank(\d+)\.csv$")


def name(kind: str, ts: str, rank: int) -> str:
    if kind not in RANK_KINDS:
        raise ValueError(f"unknown report kind {kind!r}")
    return f"{kind}_{ts}_rank{int(rank)}.csv"


def path(out_dir: str, kind: str, ts: str, rank: int) -> str:
    return os.path.join(out_dir, name(kind, ts, rank))


def rank_paths(out_dir: str, ts: str, rank: int) -> list[str]:
    """msprobe's four report files of one rank, in KINDS order (the collective CSV: `path(.., COLLECTIVE, ..)`)."""
    return [path(out_dir, kind, ts, rank) for kind in KINDS]


def parse(filename: str) -> tuple[str, str, int] | None:
    """(kind, ts, rank) of a report file name, else None."""
    m = _NAME.match(filename)
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


def session_reports(out_dir: str, ts: str) -> dict[str, tuple[str, int]]:
    """Report files of session `ts` in `out_dir`: file name -> (kind, rank)."""
    out = {}
    try:
        names = os.listdir(out_dir)
    except OSError:
        return out
    for n in names:
        p = parse(n)
        if p is not None and p[1] == ts:
            out[n] = (p[0], p[2])
    return out


def comparison_path(out_dir: str, kind: str, ts: str) -> str:
    """A report file of the offline comparison of two details CSVs (gpu_server/tools/offline.py): one file per kind, no
    rank, `{kind}_{ts}.csv` (kind: PRECISION_RESULT or PRECISION_DETAILS)."""
    if kind not in (PRECISION_RESULT, PRECISION_DETAILS):
        raise ValueError(f"unknown comparison report kind {kind!r}")
    return os.path.join(out_dir, f"{kind}_{ts}.csv")


def rank_glob(kind: str) -> str:
    """The glob pattern of one kind's per-rank report files of every session:
    "api_precision_compare_result_*_rank*.csv"."""
    if kind not in RANK_KINDS:
        raise ValueError(f"unknown report kind {kind!r}")
    return f"{kind}_*_rank*.csv"


def summary_path(out_dir: str, ts: str) -> str:
    return os.path.join(out_dir, f"summary_{ts}.json")


def html_path(out_dir: str, ts: str | None) -> str:
    """The HTML report of session `ts` (gpu_server/reports/html.py); `report.html` for a folder with no session."""
    return os.path.join(out_dir, f"report_{ts}.html" if ts else "report.html")


def api_bias_path(out_dir: str, ts: str) -> str:
    """The pooled findings across calls of session `ts` (gpu_server/checking/pooled.py): one row per API, direction,
    dtype."""
    return os.path.join(out_dir, f"api_bias_{ts}.csv")


def row_infix(direction: str) -> str:
    """What joins a call's name and an output's index in the name of a detail row: ".forward.output."."""
    return f".{direction}.output."


def row_name(call: str, direction: str, index: int) -> str:
    """The name of the detail row of output `index` of a call's `direction` ("forward" | "backward"):
    "Functional.linear.0.forward.output.1"."""
    return f"{call}{row_infix(direction)}{int(index)}"


# A detail row's name as row_name builds it and as `gpu-server compare` (msprobe's api_precision_compare) accepts it:
# a call of three or four dot-separated parts (Category.api.n, Custom.namespace.op.n), the direction, "output" and
# the output's index (six or seven parts in all).
ROW_NAME = re.compile(r"^(?P<call>[^.]*(?:\.[^.]*){2,3})"
                      r"\.(?P<direction>forward|backward)\.output\.(?P<index>[^.]*)\Z")


def split_row_name(row: str) -> tuple[str, str] | None:
    """(the call, the direction) of a detail row's name: "Functional.linear.0.forward.output.1" ->
    ("Functional.linear.0", "forward"); None for a name that is not one (ROW_NAME)."""
    m = ROW_NAME.match(row)
    return (m.group("call"), m.group("direction")) if m else None

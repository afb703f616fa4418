"""The status words of every report row and summary: msprobe's strings, their order and how rows aggregate.

    accuracy_checking_* `Status` / `Forward Test Success` ...:   pass | Warning | error | SKIP
    api_precision_compare_* `比对结果` / ...:                      pass | error | SKIP

The words only: the judging (gpu_server/judging/verdict.py, gpu_server/judging/standards/), the reports, the summary and
the HTML
page take them from here. This module imports nothing of the server but the reports' blank cell (gpu_server/columns.py;
tests/test_import_graph.py keeps it so).
"""
from __future__ import annotations

from typing import Iterable

from gpu_server.columns import BLANK

PASS, WARNING, ERROR, SKIP = "pass", "Warning", "error", "SKIP"
STATUSES = (PASS, WARNING, ERROR, SKIP)   # msprobe's status strings, in the order the summaries list them
WORST_FIRST = (ERROR, WARNING, SKIP, PASS)   # the order a page sorts and lists them in


def status_of(ok: bool) -> str:
    return PASS if ok else ERROR


def aggregate(statuses: Iterable[str]) -> str:
    """API-level Forward/Backward Test Success: any error wins, then any Warning, else pass; all SKIP -> SKIP;
    no rows -> " " (msprobe's run_ut let the last non-pass row win; docs/standards.md fixes that)."""
    statuses = list(statuses)
    if not statuses:
        return BLANK   # no rows: a call without a backward
    if all(s == SKIP for s in statuses):
        return SKIP
    if ERROR in statuses:
        return ERROR
    if WARNING in statuses:
        return WARNING
    return PASS

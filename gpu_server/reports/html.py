"""One self-contained HTML report of a `--out` folder: `report_{ts}.html` next to the CSVs.

Written by the server when it has drained (gpu_server/app.py) and on demand by `gpu-server report OUT`. It works
offline (on a cluster with no network): every plot is inline SVG drawn here, the only script is a few lines inline
(sorting and filtering the table), nothing is fetched. It reads top-down, from the first anomaly to its evidence:

- the first anomaly: the earliest failing call across ranks and the first one of each rank, with its module path,
  its source line (the first user frame), its message and a link to its error-data folder;
- the non-finite values, when the summary has them: the call where they first appear, whether the device and the
  bench (in the device dtype) overflow there, and the verdict in plain words;
- the pooled findings: a bias of an API over all its calls (in ULP) that no single call shows;
- the modules, worst first: calls, errors and warnings per module path;
- the failing and warning calls, sortable and filterable (also by link: `report.html#filter=gelu&status=error`),
  each with its module, source line, metrics, message and links to its error-data folders
  (`error_data/{ts}/{run_id}/rank{r}/{call}.step{s}/`, with `python replay.py` inside);
- the verdicts at a glance: calls, and output rows by API and by precision standard;
- for each failing API, the error distribution over its output rows: the standard's device / same-dtype ratio
  (1 = the device is as far from the bench as the trusted host's own run in that dtype), the threshold marked;
  and the device's relative (or ULP) error against the bench, failing rows in red;
- per-step trends: failing calls per step and rank, and the worst ratio per step of each failing API;
- the ranks side by side: counts per rank and failing calls per API and rank.

Everything comes from the CSV reports, read with gpu_server.reports.frame.load, and from the newest session's
`summary_{ts}.json` (first_anomaly, nonfinite, modules, api_bias). Any of those keys may be missing (an older
folder, CSVs alone): the first anomaly and the modules are then computed from the CSV rows (their Seq, Module and
Source columns), the other two sections are left out. Every string shown is escaped: module paths, source lines and
messages come from the network.
"""
from __future__ import annotations

import html
import math
import os
import time
from typing import Any
from urllib.parse import quote

import pandas as pd

from gpu_server.atomic_file import write_atomic
from gpu_server.columns import METRIC_COLUMNS
from gpu_server.judging.standards import by_algorithm
from gpu_server.reports import files as names
from gpu_server.reports.frame import load
from gpu_server.safe_open import FileRefused, read_json
from gpu_server.statuses import ERROR, PASS, SKIP, WARNING, WORST_FIRST
from protos.limits import call_api

ORDER = {s: i for i, s in enumerate(WORST_FIRST)}   # worst first
COLORS = {ERROR: "#d62728", WARNING: "#ff9f1c", SKIP: "#9e9e9e", PASS: "#2ca02c"}
# Per standard (the 比对算法 cell) the registry gives its label, its ratio columns with their limits and the
# device-vs-bench error shown beside them (gpu_server/judging/standards/registry.py, Standard): a new standard needs no
# edit
# here. The benchmark standard's limits are tier L0's (docs/standards.md): an API judged at L1/L2 fails below them.
METRIC_TITLES = dict(METRIC_COLUMNS)   # OutputMetrics attribute -> its accuracy_checking_details column
MAX_TABLE_ROWS = 5000      # failing/warning calls listed in the page (the CSVs have them all)
MAX_RANK_ROWS = 64         # ranks listed in the first-anomaly and non-finite tables
MAX_MODULE_ROWS = 40       # modules listed (worst first)
MAX_BIAS_ROWS = 100        # pooled-bias rows listed (findings first)
# our columns after msprobe's (gpu_server.columns.EXTRA_COLUMNS): the agent's record number on its rank (execution
# order), the dotted module path, the first user frame; older folders have none of them
SEQ, MODULE, SOURCE = "Seq", "Module", "Source"
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def _e(text) -> str:
    return html.escape("" if text is None or (isinstance(text, float) and math.isnan(text)) else str(text))


def _worst(statuses) -> str:
    found = [s for s in statuses if isinstance(s, str) and s.strip()]
    return min(found, key=lambda s: ORDER.get(s, 9)) if found else " "


def _num(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return ""
    v = float(v)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.4g}"


# -- SVG -------------------------------------------------------------------------------------------------------
def svg_stacked_bars(rows: list[tuple[str, dict[str, int]]], width: int = 640, bar: int = 16) -> str:
    """Horizontal stacked bars, one per (label, {status: count}), statuses in ORDER."""
    if not rows:
        return "<p class='muted'>nothing to plot</p>"
    label_w, right = 230, 60
    total_max = max(sum(c.values()) for _, c in rows) or 1
    h = len(rows) * (bar + 6) + 24
    out = [f"<svg class='plot' width='{width}' height='{h}' viewBox='0 0 {width} {h}' role='img'>"]
    for i, (label, counts) in enumerate(rows):
        y = 4 + i * (bar + 6)
        out.append(f"<text x='{label_w - 6}' y='{y + bar - 4}' text-anchor='end'>{_e(label)}</text>")
        x = float(label_w)
        for status in sorted(counts, key=lambda s: ORDER.get(s, 9)):
            n = counts[status]
            if not n:
                continue
            w = (width - label_w - right) * n / total_max
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{max(w, 1):.1f}' height='{bar}' "
                       f"fill='{COLORS.get(status, '#607d8b')}'><title>{_e(label)}: {n} {_e(status)}</title></rect>")
            x += w
        out.append(f"<text x='{x + 4:.1f}' y='{y + bar - 4}'>{sum(counts.values())}</text>")
    legend_y = h - 6
    lx = label_w
    for status in WORST_FIRST:
        out.append(f"<rect x='{lx}' y='{legend_y - 9}' width='10' height='10' fill='{COLORS[status]}'/>"
                   f"<text x='{lx + 14}' y='{legend_y}'>{status}</text>")
        lx += 80
    out.append("</svg>")
    return "".join(out)


def svg_histogram(values: list[tuple[float, bool]], threshold: float | None, xlabel: str, width: int = 420,
                  height: int = 190, bins: int = 24) -> str:
    """Histogram of positive values on a log10 axis; (value, failing) pairs, failing ones stacked in red; zero
    values are counted in a left-most "0" bin; the threshold as a dashed line."""
    finite = [(v, f) for v, f in values if v is not None and math.isfinite(v)]
    if not finite:
        return "<p class='muted'>no values</p>"
    pos = [math.log10(v) for v, _ in finite if v > 0]
    lo = min(pos + ([math.log10(threshold)] if threshold and threshold > 0 else []), default=0.0)
    hi = max(pos + ([math.log10(threshold)] if threshold and threshold > 0 else []), default=1.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    step = (hi - lo) / bins
    counts = [[0, 0] for _ in range(bins + 1)]   # index 0: zeros
    for v, failing in finite:
        i = 0 if v <= 0 else 1 + min(bins - 1, int((math.log10(v) - lo) / step))
        counts[i][1 if failing else 0] += 1
    left, bottom, top = 40, 34, 10
    pw, ph = width - left - 10, height - bottom - top
    peak = max(a + b for a, b in counts) or 1
    bw = pw / (bins + 1)
    out = [f"<svg class='plot' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img'>",
           f"<line x1='{left}' y1='{top + ph}' x2='{left + pw}' y2='{top + ph}' stroke='#444'/>",
           f"<line x1='{left}' y1='{top}' x2='{left}' y2='{top + ph}' stroke='#444'/>",
           f"<text x='{left - 4}' y='{top + 8}' text-anchor='end'>{peak}</text>",
           f"<text x='{left - 4}' y='{top + ph}' text-anchor='end'>0</text>"]
    for i, (ok, bad) in enumerate(counts):
        x = left + i * bw
        for n, color, base in ((ok, "#4c78a8", 0), (bad, COLORS[ERROR], ok)):
            if n:
                hgt = ph * n / peak
                y = top + ph - ph * base / peak - hgt
                label = "0" if i == 0 else f"10^{lo + (i - 1) * step:.2f}..10^{lo + i * step:.2f}"
                out.append(f"<rect x='{x + 1:.1f}' y='{y:.1f}' width='{bw - 2:.1f}' height='{hgt:.1f}' "
                           f"fill='{color}'><title>{label}: {n} rows</title></rect>")
    out.append(f"<text x='{left + bw / 2:.1f}' y='{top + ph + 12}' text-anchor='middle'>0</text>")
    for k in range(math.ceil(lo), math.floor(hi) + 1):
        x = left + bw * (1 + (k - lo) / step)
        out.append(f"<line x1='{x:.1f}' y1='{top + ph}' x2='{x:.1f}' y2='{top + ph + 4}' stroke='#444'/>"
                   f"<text x='{x:.1f}' y='{top + ph + 14}' text-anchor='middle'>1e{k}</text>")
    if threshold and threshold > 0:
        x = left + bw * (1 + (math.log10(threshold) - lo) / step)
        out.append(f"<line x1='{x:.1f}' y1='{top}' x2='{x:.1f}' y2='{top + ph}' stroke='#000' "
                   f"stroke-dasharray='4 3'><title>threshold {threshold:g}</title></line>"
                   f"<text x='{x + (3 if x < left + 0.7 * pw else -3):.1f}' y='{top + 10}' "
                   f"text-anchor='{'start' if x < left + 0.7 * pw else 'end'}'>threshold {threshold:g}</text>")
    out.append(f"<text x='{left + pw / 2:.1f}' y='{height - 4}' text-anchor='middle'>{_e(xlabel)}</text></svg>")
    return "".join(out)


def svg_lines(series: dict[str, list[tuple[float, float]]], ylabel: str, width: int = 560, height: int = 200,
              log: bool = False) -> str:
    """A line chart: one line (with dots) per series of (x, y) points."""
    pts = [(x, y) for s in series.values() for x, y in s if y is not None and math.isfinite(y)]
    if not pts:
        return "<p class='muted'>no values</p>"
    ty = (lambda y: math.log10(y) if y > 0 else None) if log else (lambda y: y)
    ys = [ty(y) for _, y in pts if ty(y) is not None]
    if not ys:
        return "<p class='muted'>no values</p>"
    x0, x1 = min(x for x, _ in pts), max(x for x, _ in pts)
    y0, y1 = min(ys + ([] if log else [0.0])), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    left, bottom, top, legend = 50, 30, 10, 170
    pw, ph = width - left - legend, height - bottom - top
    sx = lambda x: left + pw * (x - x0) / (x1 - x0)
    sy = lambda y: top + ph - ph * (y - y0) / (y1 - y0)
    fmt = (lambda v: f"{10 ** v:.3g}") if log else (lambda v: f"{v:g}")
    out = [f"<svg class='plot' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img'>",
           f"<line x1='{left}' y1='{top + ph}' x2='{left + pw}' y2='{top + ph}' stroke='#444'/>",
           f"<line x1='{left}' y1='{top}' x2='{left}' y2='{top + ph}' stroke='#444'/>",
           f"<text x='{left - 4}' y='{top + 8}' text-anchor='end'>{fmt(y1)}</text>",
           f"<text x='{left - 4}' y='{top + ph}' text-anchor='end'>{fmt(y0)}</text>"]
    xs = sorted({x for x, _ in pts})
    for x in xs if len(xs) <= 20 else xs[:: max(1, len(xs) // 10)]:
        out.append(f"<text x='{sx(x):.1f}' y='{top + ph + 14}' text-anchor='middle'>{x:g}</text>")
    out.append(f"<text x='{left + pw / 2:.1f}' y='{height - 2}' text-anchor='middle'>step</text>")
    out.append(f"<text x='12' y='{top + ph / 2:.1f}' transform='rotate(-90 12 {top + ph / 2:.1f})' "
               f"text-anchor='middle'>{_e(ylabel)}</text>")
    for i, (name, points) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        pp = [(sx(x), sy(ty(y))) for x, y in sorted(points) if y is not None and math.isfinite(y) and ty(y) is not None]
        if len(pp) > 1:
            out.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='"
                       + " ".join(f"{a:.1f},{b:.1f}" for a, b in pp) + "'/>")
        for (a, b), (x, y) in zip(pp, sorted(points)):
            out.append(f"<circle cx='{a:.1f}' cy='{b:.1f}' r='3' fill='{color}'><title>{_e(name)} step {x:g}: "
                       f"{_num(y)}</title></circle>")
        ly = top + 12 + i * 16
        if ly < height - 6:
            out.append(f"<rect x='{left + pw + 12}' y='{ly - 9}' width='10' height='10' fill='{color}'/>"
                       f"<text x='{left + pw + 26}' y='{ly}'>{_e(name[:26])}</text>")
    out.append("</svg>")
    return "".join(out)


# -- the data --------------------------------------------------------------------------------------------------
def _calls(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per checked call (rank, ts, call, step): the two reports' statuses and the call's verdict, and the
    call's module path, source line and record number (`module`, `source`, `seq`; blank in older folders)."""
    keys = ["rank", "ts", "call", "step"]
    extras = {MODULE: "module", SOURCE: "source", SEQ: "seq"}

    def side(kind: str, prefix: str) -> pd.DataFrame:
        frame = frames[kind]
        cols = {"forward": f"{prefix}_fwd", "backward": f"{prefix}_bwd", "message": f"{prefix}_msg"}
        cols.update({c: f"{prefix}_{name}" for c, name in extras.items() if c in frame.columns})
        return frame[keys + list(cols)].rename(columns=cols)

    # Rows carry no run id: several training runs sending the same rank, call and step to one session give rows
    # with equal keys. The two reports write a call's rows together, in the same order: the n-th of each pairs up.
    calls = _nth(side("precision_result", "p"), keys).merge(_nth(side("result", "t"), keys), on=keys + ["_n"],
                                                             how="outer").drop(columns="_n")
    for c in ("p_fwd", "p_bwd", "t_fwd", "t_bwd", "p_msg", "t_msg"):
        calls[c] = calls[c].fillna(" ").astype(str)
    for name in extras.values():
        found = [calls.pop(f"{p}_{name}") for p in ("p", "t") if f"{p}_{name}" in calls.columns]
        if name == "seq":
            seqs = [_seq(f) for f in found]
            calls[name] = seqs[0].fillna(seqs[1]) if len(seqs) == 2 else seqs[0] if seqs else float("nan")
        else:
            texts = [[_text(v) for v in f] for f in found]
            calls[name] = ([a or b for a, b in zip(*texts)] if len(texts) == 2 else texts[0] if texts
                           else [""] * len(calls))
    calls["precision"] = [_worst([a, b]) for a, b in zip(calls.p_fwd, calls.p_bwd)]
    calls["two_way"] = [_worst([a, b]) for a, b in zip(calls.t_fwd, calls.t_bwd)]
    calls["verdict"] = [_worst([a, b]) for a, b in zip(calls.precision, calls.two_way)]
    calls["api"] = calls["call"].map(call_api)
    calls["step"] = calls["step"].fillna(-1).astype(int)
    return calls


def _text(v) -> str:
    """A text cell, stripped; '' for a blank or missing one."""
    return "" if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else str(v).strip()


def _seq(values) -> pd.Series:
    """A Seq column as floats (NaN where blank): report_frame types it as a nullable integer, older code as text."""
    series = pd.Series(values).astype(object)
    return pd.to_numeric(series.where(series.notna(), None).map(_text), errors="coerce").astype(float)


def _nth(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """`frame` with `_n`: the row's place among the rows with the same keys (0, 1, ...), for a one-to-one merge."""
    return frame.assign(_n=frame.groupby(keys, dropna=False, sort=False).cumcount())


def _status_counts(series) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in series:
        s = s if s in ORDER else SKIP
        counts[s] = counts.get(s, 0) + 1
    return counts


def _error_link(out_dir: str, report_dir: str, ts: str, rank: int, call: str, step: int) -> str:
    """Links to the call's evidence folders: `error_data/{ts}/{run_id}/rank{r}/{call}.step{s}/`, one per training
    run that sent this call (gpu_server/reports/error_data.py)."""
    root = os.path.join(out_dir, "error_data", ts)
    runs = sorted(os.listdir(root)) if os.path.isdir(root) else []
    links = []
    for run in runs:
        folder = os.path.join(root, run, f"rank{rank}", f"{call}.step{step}")
        if os.path.isdir(folder) and not os.path.islink(folder):
            rel = os.path.relpath(folder, report_dir).replace(os.sep, "/")
            links.append(f"<a href='{_e(rel)}/' title='{_e(rel)}/'>{_e(call)}.step{step}/</a>")
    return " ".join(links) if links else "<span class='muted'>none</span>"


def _worst_rows(pdet: pd.DataFrame, det: pd.DataFrame, ratios: dict[str, tuple]) -> dict[tuple, dict]:
    """(rank, ts, call, step) -> metrics of its worst output row (precision details joined with details)."""
    keys = ["rank", "ts", "API Name", "step"]
    cols = ["比对结果", "比对算法"] + [c for pairs in ratios.values() for c, _ in pairs]
    cols = list(dict.fromkeys(c for c in cols if c in pdet.columns))
    joined = _nth(pdet[keys + ["call", "direction"] + cols], keys).merge(
        _nth(det[keys + ["call", "Status", "余弦相似度", "最大绝对误差", "相对误差平均值", "ULP误差平均值"]], keys)
        .rename(columns={"相对误差平均值": "dev_mean_rel", "ULP误差平均值": "dev_ulp_mean"}),
        on=keys + ["_n"], how="outer", suffixes=("", "_d")).drop(columns="_n")
    joined["call"] = joined["call"].fillna(joined.pop("call_d"))
    joined["rankorder"] = [min(ORDER.get(a, 9), ORDER.get(b, 9)) for a, b in
                           zip(joined["比对结果"].fillna(" "), joined["Status"].fillna(" "))]
    joined = joined.sort_values("rankorder", kind="stable")
    out: dict[tuple, dict] = {}
    for row in joined.to_dict("records"):
        key = (row["rank"], row["ts"], row["call"], int(row["step"]) if pd.notna(row["step"]) else -1)
        out.setdefault(key, row)
    return out


# -- the top-down view: first anomaly, non-finite values, pooled findings, modules -------------------------------
def _summary_json(out_dir: str, ts: str | None) -> dict[str, Any]:
    """The session's summary_{ts}.json as a dict; {} when there is none (the page then falls back to what the CSVs
    give). One that is a link, not a regular file, not UTF-8, not JSON or not a JSON object is refused (FileRefused,
    a ValueError naming it: gpu_server/safe_open.py); keys of other types than a server writes are ignored."""
    if not ts:
        return {}
    path = names.summary_path(out_dir, ts)
    try:
        data = read_json(path, "summary JSON")
    except FileRefused as exc:
        if exc.missing:
            return {}
        raise FileRefused(exc.path, exc.why + _MOVE_SUMMARY) from None
    if not isinstance(data, dict):
        raise FileRefused(path, f"holds a JSON {type(data).__name__}, not the object a server writes" + _MOVE_SUMMARY)
    return data   # a key of another type than a server writes is left out: its section comes from the CSVs


_MOVE_SUMMARY = "; move it out of the folder to have the report from the CSV reports alone"


def _api_bias_csv(out_dir: str, ts: str) -> str:
    """The path of the session's pooled-bias CSV (written beside the summary)."""
    return names.api_bias_path(out_dir, ts)


def _d(value) -> dict:
    return value if isinstance(value, dict) else {}


def _int(value) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) else None


def _cell_num(value) -> str:
    """A number from the summary JSON, formatted; anything else escaped as text."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _num(value)
    return _e(value)


def _module_cell(module) -> str:
    module = _text(module)
    return f"<code>{_e(module)}</code>" if module else "<span class='muted'>outside modules</span>"


def _filter_href(text: str, status: str = "") -> str:
    """A link to the failing-calls table filtered on `text` (the page's script reads the fragment)."""
    return "#filter=" + quote(text, safe="") + (f"&amp;status={quote(status, safe='')}" if status else "")


def _anomaly_candidates(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every failing row of the four reports as a first-anomaly candidate: rank, ts, step, seq, call, row,
    direction, module, source, report, message, and `kind_order` (output rows before call rows, accuracy_checking
    first) and `order` (the row's place in its file) for ties."""
    columns = ["rank", "ts", "step", "seq", "call", "row", "direction", "module", "source", "report", "status",
               "message", "kind_order", "order"]
    parts = []
    # on equal Seq: output rows before call rows, accuracy_checking before api_precision_compare (as the summary)
    for kind, status_col, report, kind_order in (("details", "Status", "accuracy_checking", 0),
                                                 ("precision_details", "比对结果", "api_precision_compare", 1),
                                                 ("result", None, "accuracy_checking", 2),
                                                 ("precision_result", None, "api_precision_compare", 3)):
        frame = frames.get(kind)
        if frame is None or not len(frame):
            continue
        if status_col is not None:
            if status_col not in frame.columns:
                continue
            bad = frame[frame[status_col].fillna("").astype(str).str.strip() == ERROR]
            rows, directions = bad["API Name"], bad["direction"]
        else:
            fwd = frame["forward"].fillna("").astype(str).str.strip() == ERROR
            bwd = frame["backward"].fillna("").astype(str).str.strip() == ERROR
            bad = frame[fwd | bwd]
            rows = bad["call"]
            directions = pd.Series(["forward" if f else "backward" for f in fwd[fwd | bwd]], index=bad.index)
        if not len(bad):
            continue
        blank = pd.Series([""] * len(bad), index=bad.index)
        parts.append(pd.DataFrame({
            "rank": bad["rank"].astype(int), "ts": bad["ts"].astype(str),
            "step": bad["step"].astype("Float64").fillna(-1).astype(int) if "step" in bad.columns else -1,
            "seq": _seq(bad[SEQ]) if SEQ in bad.columns else float("nan"),
            "call": bad["call"].astype(str), "row": rows.astype(str), "direction": directions.fillna("").astype(str),
            "module": bad[MODULE].map(_text) if MODULE in bad.columns else blank,
            "source": bad[SOURCE].map(_text) if SOURCE in bad.columns else blank,
            "report": report, "status": ERROR,
            "message": bad["Message"].map(_text) if "Message" in bad.columns else blank,
            "kind_order": kind_order, "order": bad.index.to_numpy()}))
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
    return pd.concat(parts, ignore_index=True)[columns]


def _first_anomaly_from_csv(frames: dict[str, pd.DataFrame]) -> dict:
    """The summary's `first_anomaly` computed from the CSV rows: per rank the failing row with the smallest Seq
    (without Seq: the earliest step, then file order); across ranks the smallest (step, position in the step), the
    position being Seq minus the smallest Seq of that rank and step. Entries carry `ts` (for the evidence link)."""
    cand = _anomaly_candidates(frames)
    if not len(cand):
        return {"earliest": None, "by_rank": {}}
    cand["_noseq"] = cand["seq"].isna()
    cand["_dir"] = (cand["direction"] != "forward").astype(int)
    cand = cand.sort_values(["rank", "ts", "_noseq", "seq", "step", "kind_order", "_dir", "order"], kind="stable")
    firsts = cand.groupby("rank", sort=True).head(1)
    # the smallest Seq of each (rank, ts, step) over every row of the reports, failing or not
    lows: dict[tuple, float] = {}
    for frame in frames.values():
        if SEQ not in frame.columns or not len(frame):
            continue
        seqs = pd.DataFrame({"rank": frame["rank"].astype(int), "ts": frame["ts"].astype(str),
                             "step": frame["step"].astype("Float64").fillna(-1).astype(int), "seq": _seq(frame[SEQ])})
        for key, low in seqs.dropna(subset=["seq"]).groupby(["rank", "ts", "step"])["seq"].min().items():
            lows[key] = min(low, lows.get(key, low))
    by_rank, order = {}, []
    for row in firsts.to_dict("records"):
        seq = row["seq"]
        entry = {k: row[k] for k in ("rank", "ts", "call", "row", "step", "direction", "module", "source", "report",
                                     "status", "message")}
        entry["seq"] = None if pd.isna(seq) else int(seq)
        low = lows.get((row["rank"], row["ts"], row["step"]))
        position = seq - low if not pd.isna(seq) and low is not None else math.inf
        by_rank[str(row["rank"])] = entry
        order.append(((row["ts"], row["step"], position, row["rank"]), entry))
    return {"earliest": min(order, key=lambda item: item[0])[1], "by_rank": by_rank}


def _modules_from_calls(calls: pd.DataFrame) -> list[dict] | None:
    """The summary's `modules` computed from the calls: calls, errors and warnings per module path, worst first;
    None when the reports carry no module paths (an older folder)."""
    if "module" not in calls.columns or not any(calls["module"]):
        return None
    table = calls.assign(_err=calls["verdict"] == ERROR, _warn=calls["verdict"] == WARNING).groupby(
        "module").agg(calls=("call", "size"), errors=("_err", "sum"), warnings=("_warn", "sum")).reset_index()
    table = table.sort_values(["errors", "warnings", "calls", "module"], ascending=[False, False, False, True],
                              kind="stable")
    return [{"module": m, "calls": int(c), "errors": int(e), "warnings": int(w)}
            for m, c, e, w in zip(table["module"], table["calls"], table["errors"], table["warnings"])]


def _section_first_anomaly(first: dict, origin: str, out_dir: str, report_dir: str, ts: str | None) -> list[str]:
    parts = ["<h2 id='first-anomaly'>First anomaly</h2>"]
    earliest = first.get("earliest")
    by_rank = {k: v for k, v in _d(first.get("by_rank")).items() if isinstance(v, dict)}
    if not isinstance(earliest, dict) and not by_rank:
        parts.append("<p class='ok'>No call failed.</p>")
        return parts

    def link(entry: dict) -> str:
        rank, step = _int(entry.get("rank")), _int(entry.get("step"))
        if rank is None or not _text(entry.get("call")):
            return "<span class='muted'>none</span>"
        return _error_link(out_dir, report_dir, _text(entry.get("ts")) or ts or "", rank, _text(entry.get("call")),
                           -1 if step is None else step)

    if isinstance(earliest, dict):
        parts.append(_call_box("earliest", "Earliest failing call", earliest, [
            f"<div>row <code>{_e(earliest.get('row'))}</code> &middot; {_e(earliest.get('report'))}</div>",
            f"<div class='msg'>{_e(_text(earliest.get('message'))[:600])}</div>",
            f"<div>error data: {link(earliest)}</div>"]))
    ranks = sorted(by_rank, key=lambda k: (_int(k) is None, _int(k) or 0, k))
    parts.append("<h3>First failing call of each rank</h3><div class='scroll'><table id='first-table'><thead><tr>"
                 "<th>rank</th><th>step</th><th>seq</th><th>call</th><th>row</th><th>direction</th><th>module</th>"
                 "<th>source</th><th>report</th><th>message</th><th>error data</th></tr></thead><tbody>")
    for key in ranks[:MAX_RANK_ROWS]:
        entry = by_rank[key]
        mark = " class='earliest'" if isinstance(earliest, dict) and all(
            str(entry.get(k)) == str(earliest.get(k)) for k in ("rank", "call", "row", "step")) else ""
        parts.append(
            f"<tr{mark} data-rank='{_e(key)}'><td class='num'>{_e(key)}</td>"
            f"<td class='num'>{_cell_num(entry.get('step'))}</td><td class='num'>{_cell_num(entry.get('seq'))}</td>"
            f"<td>{_e(entry.get('call'))}</td><td>{_e(entry.get('row'))}</td><td>{_e(entry.get('direction'))}</td>"
            f"<td>{_module_cell(entry.get('module'))}</td><td><code>{_e(entry.get('source'))}</code></td>"
            f"<td>{_e(entry.get('report'))}</td><td class='msg'>{_e(_text(entry.get('message'))[:600])}</td>"
            f"<td>{link(entry)}</td></tr>")
    parts += _table_end("</tbody></table></div>", len(ranks), MAX_RANK_ROWS, "the first", "ranks", origin)
    return parts


def _table_end(close: str, total: int, shown: int, which: str, noun: str, origin: str) -> list[str]:
    """The end of a bounded table: its closing tags, how many rows it shows when cut, and where the data came from."""
    out = [close]
    if total > shown:
        out.append(f"<p class='muted'>{which} {shown} of {total} {noun}</p>")
    return out + [f"<p class='muted'>{_e(origin)}</p>"]


def _call_box(box_id: str, title: str, entry: dict, more: list[str]) -> str:
    """A highlighted box naming one call: where it ran (rank, step, direction, module, source line), then `more`."""
    call = _text(entry.get("call"))
    return (f"<div class='first' id='{box_id}'>"
            f"<div class='headline'>{title}: <a href='{_e(_filter_href(call))}'><b>{_e(call)}</b></a>"
            f" on rank {_cell_num(entry.get('rank'))}, step {_cell_num(entry.get('step'))}"
            f" ({_e(entry.get('direction'))})</div>"
            f"<div>module {_module_cell(entry.get('module'))}</div>"
            f"<div>source <code>{_e(entry.get('source')) or '-'}</code></div>" + "".join(more) + "</div>")


def _overflow_words(entry: dict) -> str:
    device, bench = entry.get("device") is True, entry.get("bench") is True
    if device and bench:
        return ("not a device fault: the device and the bench (run in the device dtype) both overflow here, the "
                "training's own overflow")
    if device:
        return ("a device fault: the device output is non-finite from finite inputs while the bench in the device "
                "dtype stays finite")
    if bench:
        return "the bench (in the device dtype) overflows here, the device does not"
    return "neither the device nor the bench overflows here"


def _section_nonfinite(nonfinite: dict) -> list[str]:
    origin, first_input = nonfinite.get("origin"), nonfinite.get("first_input")
    by_rank = {k: v for k, v in _d(nonfinite.get("by_rank")).items() if isinstance(v, dict)}
    verdict = _text(nonfinite.get("verdict"))
    if not isinstance(origin, dict) and not isinstance(first_input, dict) and not verdict and not any(
            isinstance(v.get("origin"), dict) or isinstance(v.get("first_input"), dict) for v in by_rank.values()):
        return []
    parts = ["<h2 id='nonfinite'>Non-finite values (inf/nan)</h2>"]
    if verdict:
        parts.append(f"<p class='verdict' id='nonfinite-verdict'><b>{_e(verdict)}</b></p>")
    if isinstance(origin, dict):
        parts.append(_call_box("nonfinite-origin", "First non-finite output", origin, [
            f"<div>device output non-finite: <b>{'yes' if origin.get('device') is True else 'no'}</b> &middot; "
            f"bench in the device dtype non-finite: <b>{'yes' if origin.get('bench') is True else 'no'}</b></div>",
            f"<div>In plain words: {_e(_overflow_words(origin))}.</div>"]))
    elif isinstance(first_input, dict):
        parts.append(_call_box("nonfinite-origin", "First call with non-finite inputs", first_input, [
            "<div>In plain words: no checked call made them; they came from code the checker does not see (the "
            "optimizer step, the data or an unchecked region), not a device fault of a checked call.</div>"]))
    if by_rank:
        parts.append("<div class='scroll'><table id='nonfinite-table'><thead><tr><th>rank</th>"
                     "<th>first non-finite output</th><th>step</th><th>module</th><th>source</th><th>device</th>"
                     "<th>bench</th><th>first call with non-finite inputs</th><th>step</th><th>module</th>"
                     "<th>source</th></tr></thead><tbody>")
        ranks = sorted(by_rank, key=lambda k: (_int(k) is None, _int(k) or 0, k))
        for key in ranks[:MAX_RANK_ROWS]:
            o, i = _d(by_rank[key].get("origin")), _d(by_rank[key].get("first_input"))
            cells = [f"<td class='num'>{_e(key)}</td>"]
            for entry, flags in ((o, True), (i, False)):
                if entry:
                    cells += [f"<td>{_e(entry.get('call'))} <span class='muted'>{_e(entry.get('direction'))}</span>"
                              "</td>", f"<td class='num'>{_cell_num(entry.get('step'))}</td>",
                              f"<td>{_module_cell(entry.get('module'))}</td>",
                              f"<td><code>{_e(entry.get('source'))}</code></td>"]
                else:
                    cells += ["<td class='muted'>none</td>", "<td></td>", "<td></td>", "<td></td>"]
                if flags:
                    cells += [f"<td class='{'s-error' if entry.get(k) is True else ''}'>"
                              f"{'yes' if entry.get(k) is True else 'no' if entry else ''}</td>"
                              for k in ("device", "bench")]
            parts.append(f"<tr data-rank='{_e(key)}'>" + "".join(cells) + "</tr>")
        parts.append("</tbody></table></div>")
        if len(ranks) > MAX_RANK_ROWS:
            parts.append(f"<p class='muted'>the first {MAX_RANK_ROWS} of {len(ranks)} ranks</p>")
    parts.append("<p class='muted'>device: the device's output is non-finite although its inputs are finite; bench: "
                 "the bench, run in the device's dtype, is non-finite too (then the values overflow in that dtype "
                 "whatever the hardware). The first call with non-finite inputs received values from code the "
                 "checker does not see (the optimizer step, for instance).</p>")
    return parts


def _section_api_bias(bias: dict, csv_link: str | None) -> list[str]:
    rows = [a for a in bias.get("apis") or [] if isinstance(a, dict)] if isinstance(bias.get("apis"), list) else []
    findings = [a for a in bias.get("findings") or [] if isinstance(a, dict)] if isinstance(
        bias.get("findings"), list) else []
    rows = rows or findings
    if not rows and not bias:
        return []
    rank = {"error": 0, "finding": 1, "pass": 2}

    def size(a: dict) -> float:
        try:
            return -abs(float(a.get("bias_ulp")))
        except (TypeError, ValueError):
            return 0.0
    rows = sorted(rows, key=lambda a: (rank.get(_text(a.get("verdict")), 3), size(a)))
    n_findings = sum(_text(a.get("verdict")) in ("finding", "error") for a in rows)
    parts = [f"<h2 id='api-bias'>Pooled findings: bias of an API over all its calls ({n_findings})</h2>",
             "<p class='muted'>Every call of an API, direction and dtype pooled: the mean signed error of the device "
             "against the bench in ULP (bias), of its magnitude (magnitude bias), the spread of the device's errors "
             "against the same-dtype run's (spread ratio), and the smallest bias the pooled elements can detect. A "
             "bias too small for any one call to fail is a finding here"]
    extra = []
    if bias.get("false_alarm_rate_per_api") is not None:
        extra.append(f"false-alarm rate {_cell_num(bias.get('false_alarm_rate_per_api'))} per API")
    if bias.get("tests") is not None:
        extra.append(f"{_cell_num(bias.get('tests'))} tests")
    if bias.get("fail_above_ulp") is not None:
        extra.append(f"error above {_cell_num(bias.get('fail_above_ulp'))} ULP")
    parts.append((" (" + ", ".join(extra) + ")" if extra else "") + ".")
    if csv_link:
        parts.append(f" All rows: <a href='{_e(csv_link)}'>{_e(csv_link)}</a>.")
    parts.append("</p>")
    if not rows:
        parts.append("<p>No API was pooled.</p>")
        return parts
    parts.append("<div class='scroll'><table id='bias-table'><thead><tr><th>API</th><th>direction</th><th>dtype</th>"
                 "<th>calls</th><th>elements</th><th>bias (ULP)</th><th>magnitude bias (ULP)</th>"
                 "<th>spread ratio</th><th>smallest detectable bias (ULP)</th><th>verdict</th></tr></thead><tbody>")
    for a in rows[:MAX_BIAS_ROWS]:
        verdict = _text(a.get("verdict"))
        cls = {"error": "s-error", "finding": "s-finding"}.get(verdict, "s-pass" if verdict == "pass" else "")
        parts.append(
            f"<tr data-verdict='{_e(verdict)}' class='{'hot' if verdict in ('error', 'finding') else ''}'>"
            f"<td>{_e(a.get('api'))}</td><td>{_e(a.get('direction'))}</td><td>{_e(a.get('dtype'))}</td>"
            + "".join(f"<td class='num'>{_cell_num(a.get(k))}</td>" for k in
                      ("calls", "elements", "bias_ulp", "magnitude_bias_ulp", "spread_ratio", "detectable_ulp"))
            + f"<td class='{cls}'>{_e(verdict)}</td></tr>")
    parts.append("</tbody></table></div>")
    if len(rows) > MAX_BIAS_ROWS:
        parts.append(f"<p class='muted'>the first {MAX_BIAS_ROWS} of {len(rows)} rows (findings first)</p>")
    return parts


def _section_modules(modules: list | None, origin: str) -> list[str]:
    parts = ["<h2 id='modules'>Modules, worst first</h2>"]
    rows = [m for m in modules or [] if isinstance(m, dict)]
    if not rows:
        parts.append("<p class='muted'>The reports carry no module paths (an agent older than the Module column)."
                     "</p>" if modules is None else "<p class='muted'>No module was checked.</p>")
        return parts
    parts.append("<table id='module-table'><thead><tr><th>module</th><th>calls</th><th>errors</th><th>warnings</th>"
                 "</tr></thead><tbody>")
    for m in rows[:MAX_MODULE_ROWS]:
        module, errors, warnings = _text(m.get("module")), _int(m.get("errors")) or 0, _int(m.get("warnings")) or 0
        status = ERROR if errors else WARNING if warnings else ""
        label = (f"<a href='{_e(_filter_href(module, status))}'>{_module_cell(module)}</a>" if module and status
                 else _module_cell(module))
        parts.append(f"<tr data-module='{_e(module)}'><td>{label}</td><td class='num'>{_cell_num(m.get('calls'))}</td>"
                     f"<td class='num {'s-error' if errors else ''}'>{errors}</td>"
                     f"<td class='num {'s-Warning' if warnings else ''}'>{warnings}</td></tr>")
    parts += _table_end("</tbody></table>", len(rows), MAX_MODULE_ROWS, "the worst", "modules", origin)
    return parts


# -- the page --------------------------------------------------------------------------------------------------
_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 4px}
.muted{color:#777} .tiles{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.tile{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:110px}
.tile b{display:block;font-size:24px} .tile.error b{color:#d62728} .tile.Warning b{color:#e08600}
.tile.pass b{color:#2ca02c}
table{border-collapse:collapse;font-size:13px;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 6px;
text-align:left;vertical-align:top} th{background:#f3f3f3;cursor:pointer;user-select:none}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.s-error{color:#fff;background:#d62728} .s-Warning{background:#ffd79a} .s-SKIP{background:#e0e0e0}
.s-pass{color:#2ca02c}
.msg{min-width:380px;max-width:560px;font-size:12px;word-break:break-word} .scroll{overflow-x:auto}
svg.plot text{font-size:11px;fill:#333} .grid{display:flex;flex-wrap:wrap;gap:18px}
.card{border:1px solid #e3e3e3;border-radius:6px;padding:8px 12px}
input,select{font-size:13px;padding:3px 6px;margin-right:8px}
nav{margin:10px 0;font-size:13px} nav a{margin-right:12px}
.first{border:1px solid #d62728;border-left:6px solid #d62728;border-radius:6px;padding:8px 14px;margin:8px 0;
max-width:1100px;background:#fff8f8} .first div{margin:3px 0} .first .headline{font-size:16px}
.first .msg{max-width:none;color:#444} #nonfinite-origin{border-color:#7b1fa2;background:#fbf6fd}
code{font-family:SFMono-Regular,Consolas,monospace;font-size:12px;background:#f5f5f5;padding:0 3px;
word-break:break-all} td code{white-space:nowrap;word-break:normal} .ok{color:#2ca02c;font-weight:bold}
.verdict{font-size:15px}
tr.earliest td{background:#fff0f0;font-weight:bold} tr.hot td{background:#fff4e0}
tr.hot td.s-error,td.s-error{color:#fff;background:#d62728}
.s-finding,tr.hot td.s-finding{background:#ff9f1c;font-weight:bold} b.bad{color:#d62728}
"""

_JS = """
(function(){
  var t=document.getElementById('calls'); if(!t) return;
  var body=t.tBodies[0], q=document.getElementById('filter'), st=document.getElementById('status');
  function apply(){
    var text=q.value.toLowerCase(), s=st.value, shown=0;
    Array.prototype.forEach.call(body.rows,function(r){
      var ok=(!text||r.textContent.toLowerCase().indexOf(text)>=0)&&(!s||r.getAttribute('data-verdict')===s);
      r.style.display=ok?'':'none'; if(ok) shown++;
    });
    document.getElementById('shown').textContent=shown;
  }
  q.addEventListener('input',apply); st.addEventListener('change',apply);
  function fromHash(){   // #filter=TEXT&status=error: a link to a view (from another page, or this page's links)
    var found=false;
    location.hash.replace(/^#/,'').split('&').forEach(function(kv){
      var p=kv.split('='), v; try{v=decodeURIComponent(p[1]||'');}catch(e){v=p[1]||'';}
      if(p[0]==='filter'){q.value=v; found=true;} if(p[0]==='status'){st.value=v; found=true;}
    });
    if(found&&!/status=/.test(location.hash)) st.value='';
    return found;
  }
  window.addEventListener('hashchange',function(){
    if(fromHash()){apply(); document.getElementById('failing').scrollIntoView();}
  });
  fromHash();
  Array.prototype.forEach.call(t.tHead.rows[0].cells,function(th,i){
    th.addEventListener('click',function(){
      var asc=th.getAttribute('data-asc')!=='1'; th.setAttribute('data-asc',asc?'1':'0');
      var rows=Array.prototype.slice.call(body.rows);
      rows.sort(function(a,b){
        var x=a.cells[i].getAttribute('data-v')||a.cells[i].textContent,
            y=b.cells[i].getAttribute('data-v')||b.cells[i].textContent,
            nx=parseFloat(x), ny=parseFloat(y), c;
        c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);
        return asc?c:-c;
      });
      rows.forEach(function(r){body.appendChild(r);});
    });
  });
  apply();
})();
"""


def _top_down(summary: dict[str, Any], frames: dict[str, pd.DataFrame], calls: pd.DataFrame, out_dir: str,
              report_dir: str, ts: str | None) -> list[str]:
    """The top-down sections: the first anomaly, the non-finite values, the pooled findings, the modules (from the
    summary JSON where it has them, else from the CSV rows)."""
    parts: list[str] = []
    first = _d(summary.get("first_anomaly"))
    if isinstance(first.get("earliest"), dict) or any(isinstance(v, dict) for v in _d(first.get("by_rank")).values()):
        origin = f"from {os.path.basename(names.summary_path(out_dir, ts))}"
    else:   # no summary, an older one, or one whose rows had no Seq (an older agent): the CSV rows tell
        first = _first_anomaly_from_csv(frames)
        origin = ("computed from the CSV rows: per rank the failing row with the smallest Seq (execution order); "
                  "across ranks the earliest step, then the earliest place in that step")
    parts += _section_first_anomaly(first, origin, out_dir, report_dir, ts)
    parts += _section_nonfinite(_d(summary.get("nonfinite")))
    bias_csv = _api_bias_csv(out_dir, ts) if ts else ""
    bias_link = (os.path.relpath(bias_csv, report_dir).replace(os.sep, "/")
                 if bias_csv and os.path.isfile(bias_csv) else None)
    parts += _section_api_bias(_d(summary.get("api_bias")), bias_link)
    if isinstance(summary.get("modules"), list):
        parts += _section_modules(summary["modules"], f"from {os.path.basename(names.summary_path(out_dir, ts))}")
    else:
        parts += _section_modules(_modules_from_calls(calls) if len(calls) else [],
                                  "computed from the CSV rows (a call's verdict is the worst of its statuses)")
    return parts


def _collectives(summary: dict[str, Any], out_dir: str, ts: str | None) -> dict:
    """The collectives section: the summary JSON's, else counted from the session's collective CSVs."""
    saved = summary.get("collectives")
    if isinstance(saved, dict) and isinstance(saved.get("grid"), list):
        return saved
    if not ts:
        return {}
    from gpu_server.reports.summary import CollectiveCounts, _read_rows
    from gpu_server.reports.summary import _int as int_cell

    counts = CollectiveCounts()
    for name, (kind, rank) in sorted(names.session_reports(out_dir, ts).items()):
        if kind != names.COLLECTIVE:
            continue
        for row in _read_rows(os.path.join(out_dir, name)) or ():
            counts.add(rank, _text(row.get("API Name")), _text(row.get("Group")), int_cell(row.get("Group Seq")) or 0,
                       _text(row.get("Status")) or SKIP, _text(row.get("Finding")), _text(row.get("Message")),
                       members=_text(row.get("Ranks")))
    return counts.as_dict() if counts.rows_by_finding else {}


def _section_collectives(c: dict) -> list[str]:
    """A ranks x collectives grid (rows: a collective API in one group; columns: ranks; each cell coloured by its
    worst status, with the counts), and the findings that name ranks (mismatch, missing, ...)."""
    grid = [g for g in c.get("grid") or [] if isinstance(g, dict)]
    if not grid:
        return []
    ranks = sorted({int(r) for g in grid for r in _d(g.get("by_rank"))})
    by_finding = _d(c.get("records_by_finding"))
    parts = ["<h2 id='collectives'>Collectives across ranks</h2>",
             "<div class='muted'>each collective record judged against the reference computed from every member "
             "rank's inputs; records by finding: " + ", ".join(f"{_e(k)} {_e(v)}" for k, v in by_finding.items())
             + "</div>",
             "<div class='scroll'><table id='collective-grid'><thead><tr><th>collective</th><th>group</th>"
             + "".join(f"<th>rank {r}</th>" for r in ranks) + "</tr></thead><tbody>"]
    for g in grid[:MAX_TABLE_ROWS]:
        by_rank = _d(g.get("by_rank"))
        cells = []
        for r in ranks:
            counts = _d(by_rank.get(str(r)))
            if not counts:
                cells.append("<td class='muted'>-</td>")
                continue
            worst = _worst([s for s, n in counts.items() if _int(n)])
            text = ", ".join(f"{_e(s)} {_e(n)}" for s, n in counts.items() if _int(n))
            cells.append(f"<td class='s-{_e(worst)}' data-rank='{r}'>{text}</td>")
        parts.append(f"<tr><td>{_e(g.get('api'))}</td><td>{_e(g.get('group'))}</td>" + "".join(cells) + "</tr>")
    parts.append("</tbody></table></div>")
    findings = [f for f in c.get("findings") or [] if isinstance(f, dict)]
    if findings:
        parts.append("<h3>Findings that name ranks</h3><table id='collective-findings'><thead><tr><th>finding</th>"
                     "<th>call</th><th>group</th><th>group seq</th><th>ranks named</th><th>message</th></tr></thead>"
                     "<tbody>")
        for f in findings[:MAX_TABLE_ROWS]:
            named = ", ".join(str(r) for r in f.get("named") or []) or "-"
            parts.append(f"<tr><td>{_e(f.get('finding'))}</td><td>{_e(f.get('call'))}</td><td>{_e(f.get('group'))}"
                         f"</td><td class='num'>{_e(f.get('group_seq'))}</td><td>{_e(named)}</td>"
                         f"<td>{_e(f.get('message'))}</td></tr>")
        parts.append("</tbody></table>")
    return parts


def render(out_dir: str, report_dir: str | None = None) -> str:
    """The HTML text of the report of `out_dir` (links relative to `report_dir`, default `out_dir`)."""
    report_dir = report_dir or out_dir
    frames = {k: load(out_dir, k) for k in ("result", "details", "precision_result", "precision_details")}
    calls = _calls(frames)
    pdet, det = frames["precision_details"], frames["details"]
    standards = by_algorithm()
    labels = {algo: s.label for algo, s in standards.items()}
    ratios = {algo: s.ratios for algo, s in standards.items() if s.ratios}
    worst = _worst_rows(pdet, det, ratios) if len(pdet) or len(det) else {}
    sessions = sorted(set(calls["ts"].dropna()))
    ranks = sorted(set(int(r) for r in calls["rank"].dropna()))
    steps = sorted(set(int(s) for s in calls["step"] if s >= 0))
    verdicts = _status_counts(calls["verdict"])
    ts = sessions[-1] if sessions else None
    summary = _summary_json(out_dir, ts)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Online accuracy check: "
             f"{_e(os.path.basename(os.path.abspath(out_dir)))}</title><style>{_CSS}</style></head><body>",
             "<h1>Online accuracy check report</h1>",
             f"<div class='muted'>{_e(os.path.abspath(out_dir))} &middot; session {', '.join(map(_e, sessions)) or '-'}"
             f" &middot; ranks {', '.join(map(str, ranks)) or '-'} &middot; steps "
             f"{(str(steps[0]) + '-' + str(steps[-1])) if steps else '-'} &middot; written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}</div>",
             f"<div>{len(calls)} calls checked: <b class='{'bad' if verdicts.get('error') else ''}'>"
             f"{verdicts.get('error', 0)} failed</b>, {verdicts.get('Warning', 0)} with a warning, "
             f"{verdicts.get('SKIP', 0)} skipped, {verdicts.get('pass', 0)} passed</div>",
             ""]
    nav_at = len(parts) - 1   # the navigation line, once the sections present are known

    # the top-down view: the first anomaly, the non-finite values, the pooled findings, the modules
    try:
        parts += _top_down(summary, frames, calls, out_dir, report_dir, ts)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as exc:
        if not summary or isinstance(exc, FileRefused):
            raise
        raise FileRefused(names.summary_path(out_dir, ts or ""), f"holds values a server does not write "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]})" + _MOVE_SUMMARY) from None


    try:
        parts += _section_collectives(_collectives(summary, out_dir, ts))
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        if isinstance(exc, FileRefused):
            raise
        raise FileRefused(names.summary_path(out_dir, ts or ""), "holds a collectives section a server does not "
                          f"write ({type(exc).__name__})" + _MOVE_SUMMARY) from None

    sections = [("first-anomaly", "first anomaly"), ("nonfinite", "non-finite"), ("api-bias", "pooled findings"),
                ("modules", "modules"), ("collectives", "collectives"), ("failing", "failing calls"),
                ("verdicts", "verdicts"),
                ("distributions", "distributions"), ("trends", "trends"), ("ranks", "ranks")]
    present = "".join(parts)
    parts[nav_at] = "<nav>" + "".join(f"<a href='#{ident}'>{label}</a>" for ident, label in sections
                                 if ident in ("failing", "verdicts", "distributions", "trends", "ranks")
                                 or f"id='{ident}'" in present) + "</nav>"

    # failing and warning calls
    bad = calls[calls["verdict"].isin([ERROR, WARNING])].copy()
    bad["order"] = bad["verdict"].map(ORDER)
    bad = bad.sort_values(["order", "api", "rank", "step", "call"], kind="stable")
    parts.append(f"<h2 id='failing'>Failing and warning calls ({len(bad)})</h2>")
    parts.append("<div><input id='filter' placeholder='filter: API, module, source, rank, message...' size='48'>"
                 "<select id='status'><option value=''>error and Warning</option><option>error</option>"
                 "<option>Warning</option></select> <span class='muted'><span id='shown'>"
                 f"{len(bad)}</span> shown; click a header to sort</span></div>")
    parts.append("<div class='scroll'><table id='calls'><thead><tr><th>verdict</th><th>API</th><th>call</th>"
                 "<th>rank</th><th>step</th><th>module</th><th>source</th>"
                 "<th>precision fwd/bwd</th><th>two-way fwd/bwd</th><th>worst output</th><th>standard</th>"
                 "<th>ratio (device / same-dtype)</th><th>cosine</th><th>max abs err</th><th>mean rel err</th>"
                 "<th>mean ULP</th><th>message</th><th>error data</th></tr></thead><tbody>")
    for row in bad.head(MAX_TABLE_ROWS).to_dict("records"):
        w = worst.get((row["rank"], row["ts"], row["call"], row["step"]), {})
        algo = str(w.get("比对算法") or " ").strip()
        ratio = ""
        for col, _thr in ratios.get(algo, ()):
            if _num(w.get(col)):
                ratio = f"{col} {_num(w.get(col))}"
                break
        msg = row["p_msg"].strip() or row["t_msg"].strip()
        parts.append(
            f"<tr data-verdict='{_e(row['verdict'])}' data-api='{_e(row['api'])}'>"
            f"<td class='s-{_e(row['verdict'])}' data-v='{ORDER.get(row['verdict'], 9)}'>{_e(row['verdict'])}</td>"
            f"<td>{_e(row['api'])}</td><td>{_e(row['call'])}</td><td class='num'>{row['rank']}</td>"
            f"<td class='num'>{row['step']}</td><td>{_module_cell(row['module'])}</td>"
            f"<td><code>{_e(row['source'])}</code></td><td>{_e(row['p_fwd'])} / {_e(row['p_bwd'])}</td>"
            f"<td>{_e(row['t_fwd'])} / {_e(row['t_bwd'])}</td><td>{_e(w.get('API Name', ''))}</td>"
            f"<td>{_e(labels.get(algo, algo))}</td><td>{_e(ratio)}</td>"
            + "".join(f"<td class='num'>{_num(w.get(k))}</td>" for k in ("余弦相似度", "最大绝对误差", "dev_mean_rel",
                                                                       "dev_ulp_mean"))
            + f"<td class='msg'>{_e(msg[:600])}</td>"
            f"<td>{_error_link(out_dir, report_dir, row['ts'], row['rank'], row['call'], row['step'])}</td></tr>")
    parts.append("</tbody></table></div>")
    if len(bad) > MAX_TABLE_ROWS:
        parts.append(f"<p class='muted'>the first {MAX_TABLE_ROWS} of {len(bad)} calls (errors first); all of them "
                     "are in the CSV files and in gpu_server.reports.load</p>")

    # verdicts at a glance, by API and by standard
    parts.append("<h2 id='verdicts'>Verdicts at a glance</h2><div class='tiles' id='tiles'>")
    parts.append(f"<div class='tile'><b id='n-calls'>{len(calls)}</b>calls checked</div>")
    for status, label in ((ERROR, "calls failed"), (WARNING, "with a warning"), (SKIP, "skipped"),
                          (PASS, "passed")):
        parts.append(f"<div class='tile {status}'><b id='n-{status}'>{verdicts.get(status, 0)}</b>{label}</div>")
    parts.append(f"<div class='tile'><b>{len(pdet)}</b>output rows judged</div></div>")
    parts.append("<p class='muted'>A call's verdict is the worst of its forward and backward statuses in both reports: "
                 "api_precision_compare (the precision standards, judged against the same-dtype run on the trusted "
                 "host) and accuracy_checking (the two-way status against the upcast bench). See docs/standards.md."
                 "</p>")
    by_api = []
    for api, group in calls.groupby("api"):
        by_api.append((api, _status_counts(group["verdict"])))
    by_api.sort(key=lambda item: (-item[1].get(ERROR, 0), -item[1].get(WARNING, 0), item[0]))
    parts.append("<h3 id='by-api'>Verdicts by API</h3><div class='grid'><div>")
    parts.append(svg_stacked_bars(by_api[:40]))
    if len(by_api) > 40:
        parts.append(f"<p class='muted'>{len(by_api) - 40} more APIs in the table</p>")
    parts.append("</div><div><table id='api-table'><thead><tr><th>API</th><th>calls</th><th>error</th>"
                 "<th>Warning</th><th>SKIP</th><th>pass</th></tr></thead><tbody>")
    for api, c in by_api:
        parts.append(f"<tr data-api='{_e(api)}'><td>{_e(api)}</td><td class='num'>{sum(c.values())}</td>"
                     + "".join(f"<td class='num {'s-' + s if c.get(s) and s != 'pass' else ''}'>{c.get(s, 0)}</td>"
                               for s in WORST_FIRST) + "</tr>")
    parts.append("</tbody></table></div></div>")
    by_std = []
    if len(pdet):
        for algo, group in pdet.groupby(pdet["比对算法"].fillna(" ").str.strip().replace("", "none (SKIP)")):
            by_std.append((f"{labels[algo]} ({algo})" if algo in labels else algo,
                           _status_counts(group["比对结果"].fillna(SKIP))))
    parts.append("<h3 id='by-standard'>Output rows by precision standard (比对算法)</h3>")
    parts.append(svg_stacked_bars(sorted(by_std, key=lambda x: -x[1].get(ERROR, 0))))

    # error distributions of failing APIs
    failing_apis = [api for api, c in by_api if c.get(ERROR)]
    parts.append(f"<h2 id='distributions'>Error distributions of the failing APIs ({len(failing_apis)})</h2>")
    if not failing_apis:
        parts.append("<p>No API failed.</p>")
    for api in failing_apis[:20]:
        rows = pdet[pdet["api"] == api]
        failing_dirs = sorted(set(rows.loc[rows["比对结果"] == ERROR, "direction"].dropna()))
        parts.append(f"<h3 class='api-dist' data-api='{_e(api)}'>{_e(api)} "
                     f"<span class='muted'>({', '.join(failing_dirs) or 'two-way status only'})</span></h3>"
                     "<div class='grid'>")
        for direction in failing_dirs or sorted(set(rows["direction"].dropna())):
            sub = rows[rows["direction"] == direction]
            algos = [a for a in sub["比对算法"].dropna().str.strip().unique() if a in ratios]
            for algo in algos[:1]:
                arows = sub[sub["比对算法"].str.strip() == algo]
                for col, thr in ratios[algo][:2]:
                    vals = [(float(v), r == ERROR) for v, r in zip(arows[col], arows["比对结果"]) if pd.notna(v)]
                    if vals:
                        parts.append(f"<div class='card'><div>{_e(direction)} &middot; {_e(algo)} &middot; "
                                     f"{len(vals)} output rows</div>"
                                     + svg_histogram(vals, thr, f"{col} (device / same-dtype), log scale")
                                     + "</div>")
                device_error = standards[algo].device_error
                if device_error:
                    dev_col = METRIC_TITLES[device_error]
                    drows = det[(det["api"] == api) & (det["direction"] == direction)]
                    merged = drows.merge(arows[["rank", "ts", "API Name", "step", "比对结果"]],
                                         on=["rank", "ts", "API Name", "step"], how="left")
                    vals = [(float(v), r == ERROR) for v, r in zip(merged[dev_col], merged["比对结果"])
                            if pd.notna(v)]
                    if vals:
                        parts.append(f"<div class='card'><div>{_e(direction)} &middot; device against the bench"
                                     "</div>" + svg_histogram(vals, None, f"{dev_col} (device vs bench), log scale")
                                     + "</div>")
        parts.append("</div>")

    # per-step trends
    parts.append("<h2 id='trends'>Per-step trends</h2><div class='grid'>")
    series = {}
    for rank in ranks:
        sub = calls[calls["rank"] == rank]
        series[f"rank {rank}"] = [(s, float((g["verdict"] == ERROR).sum())) for s, g in sub.groupby("step")]
    parts.append("<div class='card'><div>failing calls per step</div>" + svg_lines(series, "failing calls")
                 + "</div>")
    ratio_series = {}
    for api in failing_apis[:8]:
        rows = pdet[(pdet["api"] == api) & (pdet["比对结果"].isin([ERROR, PASS]))]
        algo = next((a for a in rows["比对算法"].dropna().str.strip() if a in ratios), None)
        if algo is None:
            continue
        col = ratios[algo][0].column
        pts = [(float(s), float(g[col].max())) for s, g in rows.groupby("step") if pd.notna(g[col].max())]
        if pts:
            ratio_series[f"{api} ({col})"] = pts
    if ratio_series:
        parts.append("<div class='card'><div>worst ratio per step of each failing API (log scale)</div>"
                     + svg_lines(ratio_series, "ratio", log=True) + "</div>")
    parts.append("</div>")

    # ranks side by side
    parts.append("<h2 id='ranks'>Ranks side by side</h2><table id='rank-table'><thead><tr><th>rank</th>"
                 "<th>calls</th><th>error</th><th>Warning</th><th>SKIP</th><th>pass</th><th>steps</th></tr></thead>"
                 "<tbody>")
    for rank in ranks:
        sub = calls[calls["rank"] == rank]
        c = _status_counts(sub["verdict"])
        rs = sorted(set(int(s) for s in sub["step"] if s >= 0))
        parts.append(f"<tr data-rank='{rank}'><td>{rank}</td><td class='num'>{len(sub)}</td>"
                     + "".join(f"<td class='num {'s-' + s if c.get(s) and s != 'pass' else ''}'>{c.get(s, 0)}</td>"
                               for s in WORST_FIRST)
                     + f"<td>{(str(rs[0]) + '-' + str(rs[-1])) if rs else '-'}</td></tr>")
    parts.append("</tbody></table>")
    if failing_apis and ranks:
        parts.append("<h3>Failing calls per API and rank</h3><table id='api-rank'><thead><tr><th>API</th>"
                     + "".join(f"<th>rank {r}</th>" for r in ranks) + "</tr></thead><tbody>")
        for api in failing_apis:
            sub = calls[(calls["api"] == api) & (calls["verdict"] == ERROR)]
            counts = sub.groupby("rank").size().to_dict()
            parts.append(f"<tr><td>{_e(api)}</td>" + "".join(
                f"<td class='num {'s-error' if counts.get(r) else ''}'>{counts.get(r, 0)}</td>" for r in ranks)
                + "</tr>")
        parts.append("</tbody></table>")
    parts.append(f"<script>{_JS}</script></body></html>")
    return "".join(parts)


def write_html(out_dir: str, path: str | None = None) -> str:
    """Write the report of `out_dir` (default `{out_dir}/report_{ts}.html`, ts of the newest session); its path."""
    if path is None:
        from gpu_server.reports.frame import report_files

        sessions = sorted({ts for _, ts, _ in report_files(out_dir, "precision_result")})
        path = names.html_path(out_dir, sessions[-1] if sessions else None)
    text = render(out_dir, os.path.dirname(os.path.abspath(path)))
    write_atomic(path, lambda fh: fh.write(text))
    return path

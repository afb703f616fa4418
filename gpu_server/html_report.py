"""One self-contained HTML report of a `--out` folder: `report_{ts}.html` next to the CSVs.

Written by the server when it has drained (gpu_server/app.py) and on demand by `gpu-server report OUT`. It works
offline (on a cluster with no network): every plot is inline SVG drawn here, the only script is a few lines inline
(sorting and filtering the table), nothing is fetched. It shows

- the verdicts at a glance: calls, and output rows by API and by precision standard;
- the failing and warning calls first, sortable and filterable (also by link: `report.html#filter=gelu&status=error`),
  each with its metrics, its message and links to its error-data folders
  (`error_data/{ts}/{run_id}/rank{r}/{call}.step{s}/`, with `python replay.py` inside);
- for each failing API, the error distribution over its output rows: the standard's device / same-dtype ratio
  (1 = the device is as far from the bench as the trusted host's own run in that dtype), the threshold marked;
  and the device's relative (or ULP) error against the bench, failing rows in red;
- per-step trends: failing calls per step and rank, and the worst ratio per step of each failing API;
- the ranks side by side: counts per rank and failing calls per API and rank.

Everything comes from the CSV reports, read with gpu_server.report_frame.load.
"""
from __future__ import annotations

import html
import math
import os
import time

import pandas as pd

from gpu_server.atomic_file import write_atomic
from gpu_server.report_frame import load
from gpu_server.summary import STANDARD_NAMES

ORDER = {"error": 0, "Warning": 1, "SKIP": 2, "pass": 3}
COLORS = {"error": "#d62728", "Warning": "#ff9f1c", "SKIP": "#9e9e9e", "pass": "#2ca02c"}
# per algorithm (比对算法): the ratio columns of api_precision_compare_details and their error thresholds
RATIOS = {
    "标杆比对法": [("相对误差平均值比值", 2.0), ("均方根误差比值", 2.0), ("小值域错误比值", 2.0),
              ("相对误差最大值比值", 10.0)],
    "ULP误差比对法": [("ULP误差大于阈值占比比值", 1.0)],
    "绝对阈值法": [("相对误差错误率", 0.0), ("绝对误差错误率", 0.0), ("inf/nan错误率", 0.0)],
    "二进制一致法": [("二进制一致错误率", 0.0)],
    "双千指标法": [("双千指标", 0.999)],
}
# the device-vs-bench error shown beside the ratios (accuracy_checking_details), by algorithm
DEVICE_ERROR = {"ULP误差比对法": "ULP误差平均值", "标杆比对法": "相对误差平均值", "绝对阈值法": "相对误差最大值"}
MAX_TABLE_ROWS = 5000      # failing/warning calls listed in the page (the CSVs have them all)
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
    for status in ("error", "Warning", "SKIP", "pass"):
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
        for n, color, base in ((ok, "#4c78a8", 0), (bad, COLORS["error"], ok)):
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
    """One row per checked call (rank, ts, call, step): the two reports' statuses and the call's verdict."""
    keys = ["rank", "ts", "call", "step"]
    pr = frames["precision_result"][keys + ["forward", "backward", "message"]].rename(
        columns={"forward": "p_fwd", "backward": "p_bwd", "message": "p_msg"})
    rr = frames["result"][keys + ["forward", "backward", "message"]].rename(
        columns={"forward": "t_fwd", "backward": "t_bwd", "message": "t_msg"})
    # Rows carry no run id: several training runs sending the same rank, call and step to one session give rows
    # with equal keys. The two reports write a call's rows together, in the same order: the n-th of each pairs up.
    calls = _nth(pr, keys).merge(_nth(rr, keys), on=keys + ["_n"], how="outer").drop(columns="_n")
    for c in ("p_fwd", "p_bwd", "t_fwd", "t_bwd", "p_msg", "t_msg"):
        calls[c] = calls[c].fillna(" ").astype(str)
    calls["precision"] = [_worst([a, b]) for a, b in zip(calls.p_fwd, calls.p_bwd)]
    calls["two_way"] = [_worst([a, b]) for a, b in zip(calls.t_fwd, calls.t_bwd)]
    calls["verdict"] = [_worst([a, b]) for a, b in zip(calls.precision, calls.two_way)]
    calls["api"] = calls["call"].str.split(".").str[:2].str.join(".")
    calls["step"] = calls["step"].fillna(-1).astype(int)
    return calls


def _nth(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """`frame` with `_n`: the row's place among the rows with the same keys (0, 1, ...), for a one-to-one merge."""
    return frame.assign(_n=frame.groupby(keys, dropna=False, sort=False).cumcount())


def _status_counts(series) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in series:
        s = s if s in ORDER else "SKIP"
        counts[s] = counts.get(s, 0) + 1
    return counts


def _error_link(out_dir: str, report_dir: str, ts: str, rank: int, call: str, step: int) -> str:
    """Links to the call's evidence folders: `error_data/{ts}/{run_id}/rank{r}/{call}.step{s}/`, one per training
    run that sent this call (gpu_server/error_data.py)."""
    root = os.path.join(out_dir, "error_data", ts)
    runs = sorted(os.listdir(root)) if os.path.isdir(root) else []
    links = []
    for run in runs:
        folder = os.path.join(root, run, f"rank{rank}", f"{call}.step{step}")
        if os.path.isdir(folder) and not os.path.islink(folder):
            rel = os.path.relpath(folder, report_dir).replace(os.sep, "/")
            links.append(f"<a href='{_e(rel)}/' title='{_e(rel)}/'>{_e(call)}.step{step}/</a>")
    return " ".join(links) if links else "<span class='muted'>none</span>"


def _worst_rows(pdet: pd.DataFrame, det: pd.DataFrame) -> dict[tuple, dict]:
    """(rank, ts, call, step) -> metrics of its worst output row (precision details joined with details)."""
    keys = ["rank", "ts", "API Name", "step"]
    cols = ["比对结果", "比对算法"] + [c for pairs in RATIOS.values() for c, _ in pairs]
    cols = list(dict.fromkeys(c for c in cols if c in pdet.columns))
    joined = _nth(pdet[keys + ["call", "direction"] + cols], keys).merge(
        _nth(det[keys + ["Status", "余弦相似度", "最大绝对误差", "相对误差平均值", "ULP误差平均值"]], keys)
        .rename(columns={"相对误差平均值": "dev_mean_rel", "ULP误差平均值": "dev_ulp_mean"}),
        on=keys + ["_n"], how="outer", suffixes=("", "_d")).drop(columns="_n")
    joined["call"] = joined["call"].fillna(joined["API Name"].str.rsplit(".", n=3).str[0])
    joined["rankorder"] = [min(ORDER.get(a, 9), ORDER.get(b, 9)) for a, b in
                           zip(joined["比对结果"].fillna(" "), joined["Status"].fillna(" "))]
    joined = joined.sort_values("rankorder", kind="stable")
    out: dict[tuple, dict] = {}
    for row in joined.to_dict("records"):
        key = (row["rank"], row["ts"], row["call"], int(row["step"]) if pd.notna(row["step"]) else -1)
        out.setdefault(key, row)
    return out


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
  location.hash.replace(/^#/,'').split('&').forEach(function(kv){   // #filter=TEXT&status=error: a link to a view
    var p=kv.split('='), v=decodeURIComponent(p[1]||'');
    if(p[0]==='filter') q.value=v; if(p[0]==='status') st.value=v;
  });
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


def render(out_dir: str, report_dir: str | None = None) -> str:
    """The HTML text of the report of `out_dir` (links relative to `report_dir`, default `out_dir`)."""
    report_dir = report_dir or out_dir
    frames = {k: load(out_dir, k) for k in ("result", "details", "precision_result", "precision_details")}
    calls = _calls(frames)
    pdet, det = frames["precision_details"], frames["details"]
    worst = _worst_rows(pdet, det) if len(pdet) or len(det) else {}
    sessions = sorted(set(calls["ts"].dropna()))
    ranks = sorted(set(int(r) for r in calls["rank"].dropna()))
    steps = sorted(set(int(s) for s in calls["step"] if s >= 0))
    verdicts = _status_counts(calls["verdict"])
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Online accuracy check: "
             f"{_e(os.path.basename(os.path.abspath(out_dir)))}</title><style>{_CSS}</style></head><body>",
             "<h1>Online accuracy check report</h1>",
             f"<div class='muted'>{_e(os.path.abspath(out_dir))} &middot; session {', '.join(map(_e, sessions)) or '-'}"
             f" &middot; ranks {', '.join(map(str, ranks)) or '-'} &middot; steps "
             f"{(str(steps[0]) + '-' + str(steps[-1])) if steps else '-'} &middot; written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}</div>",
             "<div class='tiles' id='tiles'>",
             f"<div class='tile'><b id='n-calls'>{len(calls)}</b>calls checked</div>"]
    for status, label in (("error", "calls failed"), ("Warning", "with a warning"), ("SKIP", "skipped"),
                          ("pass", "passed")):
        parts.append(f"<div class='tile {status}'><b id='n-{status}'>{verdicts.get(status, 0)}</b>{label}</div>")
    parts.append(f"<div class='tile'><b>{len(pdet)}</b>output rows judged</div></div>")
    parts.append("<p class='muted'>A call's verdict is the worst of its forward and backward statuses in both reports: "
                 "api_precision_compare (the precision standards, judged against the same-dtype run on the trusted "
                 "host) and accuracy_checking (the two-way status against the upcast bench). See docs/standards.md."
                 "</p>")

    # verdicts by API and by standard
    by_api = []
    for api, group in calls.groupby("api"):
        by_api.append((api, _status_counts(group["verdict"])))
    by_api.sort(key=lambda item: (-item[1].get("error", 0), -item[1].get("Warning", 0), item[0]))
    parts.append("<h2 id='by-api'>Verdicts by API</h2><div class='grid'><div>")
    parts.append(svg_stacked_bars(by_api[:40]))
    if len(by_api) > 40:
        parts.append(f"<p class='muted'>{len(by_api) - 40} more APIs in the table</p>")
    parts.append("</div><div><table id='api-table'><thead><tr><th>API</th><th>calls</th><th>error</th>"
                 "<th>Warning</th><th>SKIP</th><th>pass</th></tr></thead><tbody>")
    for api, c in by_api:
        parts.append(f"<tr data-api='{_e(api)}'><td>{_e(api)}</td><td class='num'>{sum(c.values())}</td>"
                     + "".join(f"<td class='num {'s-' + s if c.get(s) and s != 'pass' else ''}'>{c.get(s, 0)}</td>"
                               for s in ("error", "Warning", "SKIP", "pass")) + "</tr>")
    parts.append("</tbody></table></div></div>")
    by_std = []
    if len(pdet):
        for algo, group in pdet.groupby(pdet["比对算法"].fillna(" ").str.strip().replace("", "none (SKIP)")):
            by_std.append((f"{STANDARD_NAMES.get(algo, algo)} ({algo})" if algo in STANDARD_NAMES else algo,
                           _status_counts(group["比对结果"].fillna("SKIP"))))
    parts.append("<h2 id='by-standard'>Output rows by precision standard (比对算法)</h2>")
    parts.append(svg_stacked_bars(sorted(by_std, key=lambda x: -x[1].get("error", 0))))

    # failing and warning calls
    bad = calls[calls["verdict"].isin(["error", "Warning"])].copy()
    bad["order"] = bad["verdict"].map(ORDER)
    bad = bad.sort_values(["order", "api", "rank", "step", "call"], kind="stable")
    parts.append(f"<h2 id='failing'>Failing and warning calls ({len(bad)})</h2>")
    parts.append("<div><input id='filter' placeholder='filter: API, rank, message...' size='40'>"
                 "<select id='status'><option value=''>error and Warning</option><option>error</option>"
                 "<option>Warning</option></select> <span class='muted'><span id='shown'>"
                 f"{len(bad)}</span> shown; click a header to sort</span></div>")
    parts.append("<div class='scroll'><table id='calls'><thead><tr><th>verdict</th><th>API</th><th>call</th>"
                 "<th>rank</th><th>step</th>"
                 "<th>precision fwd/bwd</th><th>two-way fwd/bwd</th><th>worst output</th><th>standard</th>"
                 "<th>ratio (device / same-dtype)</th><th>cosine</th><th>max abs err</th><th>mean rel err</th>"
                 "<th>mean ULP</th><th>message</th><th>error data</th></tr></thead><tbody>")
    for row in bad.head(MAX_TABLE_ROWS).to_dict("records"):
        w = worst.get((row["rank"], row["ts"], row["call"], row["step"]), {})
        algo = str(w.get("比对算法") or " ").strip()
        ratio = ""
        for col, _thr in RATIOS.get(algo, []):
            if _num(w.get(col)):
                ratio = f"{col} {_num(w.get(col))}"
                break
        msg = row["p_msg"].strip() or row["t_msg"].strip()
        parts.append(
            f"<tr data-verdict='{_e(row['verdict'])}' data-api='{_e(row['api'])}'>"
            f"<td class='s-{_e(row['verdict'])}' data-v='{ORDER.get(row['verdict'], 9)}'>{_e(row['verdict'])}</td>"
            f"<td>{_e(row['api'])}</td><td>{_e(row['call'])}</td><td class='num'>{row['rank']}</td>"
            f"<td class='num'>{row['step']}</td><td>{_e(row['p_fwd'])} / {_e(row['p_bwd'])}</td>"
            f"<td>{_e(row['t_fwd'])} / {_e(row['t_bwd'])}</td><td>{_e(w.get('API Name', ''))}</td>"
            f"<td>{_e(STANDARD_NAMES.get(algo, algo))}</td><td>{_e(ratio)}</td>"
            + "".join(f"<td class='num'>{_num(w.get(k))}</td>" for k in ("余弦相似度", "最大绝对误差", "dev_mean_rel",
                                                                       "dev_ulp_mean"))
            + f"<td class='msg'>{_e(msg[:600])}</td>"
            f"<td>{_error_link(out_dir, report_dir, row['ts'], row['rank'], row['call'], row['step'])}</td></tr>")
    parts.append("</tbody></table></div>")
    if len(bad) > MAX_TABLE_ROWS:
        parts.append(f"<p class='muted'>the first {MAX_TABLE_ROWS} of {len(bad)} calls (errors first); all of them "
                     "are in the CSV files and in gpu_server.reports.load</p>")

    # error distributions of failing APIs
    failing_apis = [api for api, c in by_api if c.get("error")]
    parts.append(f"<h2 id='distributions'>Error distributions of the failing APIs ({len(failing_apis)})</h2>")
    if not failing_apis:
        parts.append("<p>No API failed.</p>")
    for api in failing_apis[:20]:
        rows = pdet[pdet["api"] == api]
        failing_dirs = sorted(set(rows.loc[rows["比对结果"] == "error", "direction"].dropna()))
        parts.append(f"<h3 class='api-dist' data-api='{_e(api)}'>{_e(api)} "
                     f"<span class='muted'>({', '.join(failing_dirs) or 'two-way status only'})</span></h3>"
                     "<div class='grid'>")
        for direction in failing_dirs or sorted(set(rows["direction"].dropna())):
            sub = rows[rows["direction"] == direction]
            algos = [a for a in sub["比对算法"].dropna().str.strip().unique() if a in RATIOS]
            for algo in algos[:1]:
                arows = sub[sub["比对算法"].str.strip() == algo]
                for col, thr in RATIOS[algo][:2]:
                    vals = [(float(v), r == "error") for v, r in zip(arows[col], arows["比对结果"]) if pd.notna(v)]
                    if vals:
                        parts.append(f"<div class='card'><div>{_e(direction)} &middot; {_e(algo)} &middot; "
                                     f"{len(vals)} output rows</div>"
                                     + svg_histogram(vals, thr, f"{col} (device / same-dtype), log scale")
                                     + "</div>")
                dev_col = DEVICE_ERROR.get(algo)
                if dev_col:
                    drows = det[(det["api"] == api) & (det["direction"] == direction)]
                    merged = drows.merge(arows[["rank", "ts", "API Name", "step", "比对结果"]],
                                         on=["rank", "ts", "API Name", "step"], how="left")
                    vals = [(float(v), r == "error") for v, r in zip(merged[dev_col], merged["比对结果"])
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
        series[f"rank {rank}"] = [(s, float((g["verdict"] == "error").sum())) for s, g in sub.groupby("step")]
    parts.append("<div class='card'><div>failing calls per step</div>" + svg_lines(series, "failing calls")
                 + "</div>")
    ratio_series = {}
    for api in failing_apis[:8]:
        rows = pdet[(pdet["api"] == api) & (pdet["比对结果"].isin(["error", "pass"]))]
        algo = next((a for a in rows["比对算法"].dropna().str.strip() if a in RATIOS), None)
        if algo is None:
            continue
        col = RATIOS[algo][0][0]
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
                               for s in ("error", "Warning", "SKIP", "pass"))
                     + f"<td>{(str(rs[0]) + '-' + str(rs[-1])) if rs else '-'}</td></tr>")
    parts.append("</tbody></table>")
    if failing_apis and ranks:
        parts.append("<h3>Failing calls per API and rank</h3><table id='api-rank'><thead><tr><th>API</th>"
                     + "".join(f"<th>rank {r}</th>" for r in ranks) + "</tr></thead><tbody>")
        for api in failing_apis:
            sub = calls[(calls["api"] == api) & (calls["verdict"] == "error")]
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
        from gpu_server.report_frame import report_files

        sessions = sorted({ts for _, ts, _ in report_files(out_dir, "precision_result")})
        name = f"report_{sessions[-1]}.html" if sessions else "report.html"
        path = os.path.join(out_dir, name)
    text = render(out_dir, os.path.dirname(os.path.abspath(path)))
    write_atomic(path, lambda fh: fh.write(text))
    return path
